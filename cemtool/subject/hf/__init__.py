"""Models cemtool did not train: Hugging Face causal LMs behind cemtool's names and hook points (docs/models.md).

:func:`load_foreign` is what :func:`cemtool.subject.open_subject` calls for a local Hugging Face directory or an
``hf:ORG/NAME[@REVISION]`` id; it returns the same :class:`~cemtool.subject.base.Subject` a cemtool run gives, so
no analysis asks where its model came from. The per-family mapping of modules to hook points is one short file per
family (gpt2.py, gpt_neox.py, llama.py) on top of adapter.py.
"""

from cemtool.subject.hf.loader import is_foreign, load_foreign

__all__ = ["is_foreign", "load_foreign"]
