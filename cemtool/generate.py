"""Text generation from a trained model: seeded sampling with temperature and top-k (``cemtool sample``).

One token at a time: the model sees the last ``context`` tokens (its max_seq_len, or a Hugging Face model's
max_position_embeddings), its logits at the last position are restricted to the tokenizer's ids, divided by the
temperature, cut to the ``top_k`` largest, and one id is drawn from their softmax with a seeded CPU generator in
float64, so the same seed gives the same text on every device where the model gives the same logits. Temperature
0 (or top-k 1) takes the argmax: greedy decoding, no randomness.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from cemtool.errors import CemtoolError

MAX_TOKENS = 4096  # new tokens per sample: every token is a full forward pass over the window (no KV cache)
MAX_SAMPLES = 100
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SampleOptions:
    """What to generate. ``temperature`` 0 = greedy; ``top_k`` None = the whole vocabulary."""

    tokens: int = 100
    temperature: float = 1.0
    top_k: int | None = None
    seed: int = 0
    num_samples: int = 1

    def check(self, vocab_size: int | None = None) -> None:
        """Every number in range (top-k against ``vocab_size`` when given), or one CemtoolError naming the
        option."""
        if not 1 <= self.tokens <= MAX_TOKENS:
            raise CemtoolError(f"--tokens must be between 1 and {MAX_TOKENS}, got {self.tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise CemtoolError(f"--temperature must be a finite number >= 0, got {self.temperature}",
                               hint="0 = greedy (argmax) decoding; 1 = the model's own distribution")
        if self.top_k is not None and self.top_k < 1:
            raise CemtoolError(f"--top-k must be >= 1, got {self.top_k}", hint="1 = greedy; leave it out for all ids")
        if self.top_k is not None and vocab_size is not None and self.top_k > vocab_size:
            raise CemtoolError(f"--top-k must be between 1 and the vocabulary size {vocab_size:,}, got {self.top_k}")
        if not 0 <= self.seed <= MAX_SEED:
            raise CemtoolError(f"--seed must be between 0 and 2**63 - 1, got {self.seed}")
        if not 1 <= self.num_samples <= MAX_SAMPLES:
            raise CemtoolError(f"--num-samples must be between 1 and {MAX_SAMPLES}, got {self.num_samples}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def to_dict(self) -> dict:
        return {**asdict(self), "greedy": self.greedy}


def encode_prompt(tokenizer, text: str) -> list[int]:
    """The prompt's ids, or one CemtoolError: text the tokenizer cannot encode (a word outside a word-level
    vocabulary, a character a Hugging Face tokenizer maps to its unknown token), or a prompt of no tokens."""
    try:
        ids = tokenizer.encode(text)
    except CemtoolError as e:
        raise CemtoolError(f"--prompt: {e.message}", hint="write the prompt in the run's own vocabulary") from None
    unk = getattr(getattr(tokenizer.hf, "model", None), "unk_token", None)
    unk_id = tokenizer.hf.token_to_id(unk) if unk else None
    if unk_id is not None and unk_id in ids:
        bad = next((c for c in text if unk_id in tokenizer.encode(c)), "?")
        raise CemtoolError(f"--prompt: the {tokenizer.kind} tokenizer cannot encode the character {bad!r} "
                           f"(U+{ord(bad):04X}): it becomes the unknown token {unk!r}",
                           hint="leave that character out of the prompt")
    if not ids:
        raise CemtoolError(f"--prompt {text!r} encodes to no tokens", hint="give a prompt with some text")
    return ids


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, gen: torch.Generator) -> int:
    """One id from (V,) logits: the argmax when greedy, else a draw from softmax(logits / T) over the top_k."""
    logits = logits.detach().to("cpu", torch.float64)  # (V,)
    if temperature == 0 or top_k == 1:
        return int(torch.argmax(logits))
    scaled = logits / temperature  # (V,)
    if top_k is not None and top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # (V,)
    return int(torch.multinomial(probs, 1, generator=gen))


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: list[int], opts: SampleOptions, *, context: int, vocab_size: int,
             gen: torch.Generator) -> list[int]:
    """``opts.tokens`` new ids after ``prompt``; the model sees at most the last ``context`` tokens; ids at or
    above ``vocab_size`` (a head wider than the tokenizer) are never drawn."""
    device = next(model.parameters()).device
    ids = list(prompt)
    for _ in range(opts.tokens):
        window = torch.tensor([ids[-context:]], dtype=torch.long, device=device)  # (1, <= context)
        logits = model(window)[0, -1, :vocab_size]  # (V,)
        ids.append(next_token(logits, opts.temperature, opts.top_k, gen))
    return ids[len(prompt):]


def model_context(loaded) -> int:
    """How many tokens the model can see: a Hugging Face model's max_position_embeddings, else max_seq_len."""
    return int(getattr(loaded.model, "max_seq_len", 0) or loaded.config.model.max_seq_len)


def sample(loaded, prompt: str | None, opts: SampleOptions) -> dict:
    """Generate ``opts.num_samples`` continuations of ``prompt`` (None: the first token id, 0) from a loaded run.
    The result: the settings, the prompt's ids, and per sample its new ids and text (the prompt not included)."""
    tok = loaded.tokenizer
    vocab = min(tok.vocab_size, int(loaded.config.model.vocab_size))
    opts.check(vocab)
    ids = [0] if prompt is None else encode_prompt(tok, prompt)
    context = model_context(loaded)
    if any(i >= vocab for i in ids):
        raise CemtoolError(f"--prompt: token id {max(ids)} is outside the model's {vocab:,} ids")
    gen = torch.Generator().manual_seed(opts.seed)
    was = loaded.model.training
    loaded.model.eval()
    try:
        samples = []
        for _ in range(opts.num_samples):
            new = generate(loaded.model, ids, opts, context=context, vocab_size=vocab, gen=gen)
            samples.append({"ids": new, "text": tok.decode(new)})
    finally:
        loaded.model.train(was)
    return {"settings": opts.to_dict(), "prompt": prompt, "prompt_ids": ids, "context": context,
            "vocab_size": vocab, "samples": samples}
