"""The registry of architectures: :mod:`cemtool.architectures` (name -> family, builder and preset; families
register themselves there) and :func:`build_model`, which builds one after checking that it fits in memory.
"""

from __future__ import annotations

from cemtool.architectures import FAMILY_MODULES, ArchSpec, arch_list, archs, get_arch, register
from cemtool.models.sizing import check_memory


def build_model(cfg):
    """Instantiate the LM for a resolved ModelConfig (vocab_size and max_seq_len set). Refused before anything
    is allocated if its weights cannot fit in the memory available (it is built on the CPU, then moved)."""
    check_memory(cfg, "cpu", what="building")
    return get_arch(cfg.arch).build(cfg)


__all__ = ["FAMILY_MODULES", "ArchSpec", "arch_list", "archs", "build_model", "get_arch", "register"]
