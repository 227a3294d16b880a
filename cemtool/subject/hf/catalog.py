"""What loads and in which tier: the declared family adapters (tier b), the installed transformers' causal-LM
families with the tier each gets (:func:`hf_families`, ``cemtool archs --hf``), and the table of the adapters that
docs/models.md shows, generated from their declarations (``cemtool archs --hf --markdown`` prints it;
tests/cli/test_hf_families.py checks the docs hold the current one). Adding a family: its file, one line in
:data:`FAMILIES` (docs/adding_a_family.md)."""

from __future__ import annotations

from cemtool.errors import CemtoolError
from cemtool.subject.hf.adapter import Family
from cemtool.subject.hf.bloom import Bloom
from cemtool.subject.hf.cohere import Cohere
from cemtool.subject.hf.falcon import Falcon
from cemtool.subject.hf.gemma2 import Gemma2
from cemtool.subject.hf.gemma3 import Gemma3
from cemtool.subject.hf.gpt2 import GPT2
from cemtool.subject.hf.gpt_bigcode import GPTBigCode
from cemtool.subject.hf.gpt_neox import GPTNeoX
from cemtool.subject.hf.gptj import GPTJ
from cemtool.subject.hf.llama import LlamaLike
from cemtool.subject.hf.olmo2 import Olmo2
from cemtool.subject.hf.opt import OPT
from cemtool.subject.hf.phi import Phi
from cemtool.subject.hf.phi3 import Phi3
from cemtool.subject.hf.qwen3 import Qwen3
from cemtool.subject.hf.smollm3 import SmolLM3
from cemtool.subject.hf.stablelm import StableLM

FAMILIES: tuple[Family, ...] = (GPT2(), GPTBigCode(), GPTNeoX(), GPTJ(), LlamaLike(), Qwen3(), Olmo2(), Phi(),
                                Phi3(), Gemma2(), Gemma3(), Cohere(), StableLM(), SmolLM3(), OPT(), Bloom(),
                                Falcon())
BEGIN, END = "<!-- families: begin (generated: cemtool archs --hf --markdown) -->", "<!-- families: end -->"


def family_adapters() -> dict[str, Family]:
    """The family adapter of every model type that has one."""
    return {t: fam for fam in FAMILIES for t in fam.model_types}


def family_of(config):
    """(the family adapter for this config, None) or (None, why not): tier a for a model type without an adapter,
    and for a config its family refuses by name (a structure its declarations do not cover)."""
    fam = family_adapters().get(config.model_type)
    if fam is None:
        return None, None
    why = fam.refuse(config)
    return (fam, None) if why is None else (None, f"the {fam.name} adapter does not map this config: {why}")


def transformers_module():
    """transformers, or one line saying which extra installs it."""
    try:
        import transformers  # optional dependency: transformers (the extra cemtool[hf])
    except ImportError:
        raise CemtoolError("loading Hugging Face models needs the transformers package",
                           hint='install the extra: pip install -e ".[hf]"') from None
    transformers.utils.logging.disable_progress_bar()  # cemtool prints its own progress
    return transformers


def hf_families() -> list[dict]:
    """Every model type of the installed transformers' causal-LM mapping, and the tier cemtool gives it: ``b`` (a
    declared family adapter: every analysis), ``a`` (through the logits alone: sharpness and forgetting; the load-time
    causality check still applies), or refused by kind (encoder-decoder; an encoder whose causal head needs
    ``is_decoder``). Read from the mapping and the config classes' defaults: no model is built."""
    transformers = transformers_module()
    CONFIG_MAPPING = transformers.models.auto.configuration_auto.CONFIG_MAPPING
    CAUSAL = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    MASKED = transformers.models.auto.modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES

    adapters = family_adapters()
    rows = []
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()  # default configs warn about their own token ids
    try:
        kinds = {}
        for mt in CAUSAL:
            try:
                kinds[mt] = bool(getattr(CONFIG_MAPPING[mt](), "is_encoder_decoder", False))
            except Exception:  # noqa: BLE001  (a config class without usable defaults: judged when loaded)
                kinds[mt] = False
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
    for mt, cls in sorted(CAUSAL.items()):
        enc_dec = kinds[mt]
        if mt in adapters:
            tier, note = "b", f"adapter {adapters[mt].name}: every analysis"
        elif enc_dec:
            tier, note = "refused", "encoder-decoder"
        elif mt in MASKED:
            tier, note = "a", "an encoder family: only a config with is_decoder=true is causal (checked at load)"
        else:
            tier, note = "a", "logits only: sharpness, forgetting (collapse-report and saturation need an adapter)"
        rows.append({"model_type": mt, "class": cls if isinstance(cls, str) else str(cls), "tier": tier,
                     "note": note})
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def families_table() -> str:
    """docs/models.md's table of the tier-b families, from each family's declarations."""
    rows = ["| family file | `model_type` | residual | norms | positions | q/k scores bilinear | hook points |",
            "|---|---|---|---|---|---|---|"]
    for fam in FAMILIES:
        types = ", ".join(f"`{t}`" for t in fam.model_types)
        points = "; ".join(f"{k}: {v}" for k, v in fam.points.items())
        extras = [w for w, on in (("soft-capped logits", type(fam).softcap is not Family.softcap),
                                  (f"router hook points ({', '.join(fam.routers)})", bool(fam.routers))) if on]
        hooks = "; ".join([points, *extras])
        rows.append(f"| `cemtool/subject/hf/{type(fam).__module__.rsplit('.', 1)[1]}.py` | {types} | "
                    f"{_cell(fam.residual)} | {_cell(fam.norms)} | {_cell(fam.positions)} | "
                    f"{'yes' if fam.bilinear_qk else 'no'} | {_cell(hooks)} |")
    return "\n".join([BEGIN, *rows, END])

