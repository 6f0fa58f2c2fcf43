"""Two import-time costs every posttrain process that loads transformers would pay for nothing, removed when
the `stages` package is first imported (`lighten_imports`; it imports nothing heavy itself):

- `importlib.metadata.packages_distributions()` walks every installed distribution's file list (~1 s of CPU in
  this project's environment); transformers and TRL each call it once at import. Cached here: the second call
  is free. The installed packages do not change under a running process.
- transformers imports scikit-learn (~2 s) when it is installed (MLflow requires it) only for assisted decoding
  across tokenizers (`generation/candidate_generator.py`), which posttrain never uses. Right after
  `transformers.utils.import_utils` is loaded, its cached `is_sklearn_available()` is asked once while
  scikit-learn is hidden, so it answers False; `import sklearn` itself (a user's reward) works as before.

Measured: importing TRL's SFTTrainer ~3 s less CPU per process (benchmarks/process_start.py).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.metadata
import sys

TRANSFORMERS_IMPORT_UTILS = "transformers.utils.import_utils"


class _TransformersWithoutSklearn(importlib.abc.MetaPathFinder):
    """Finds transformers.utils.import_utils as the path finder does and, after its module runs, answers its
    cached `is_sklearn_available()` once with scikit-learn hidden. Removes itself on that first find."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TRANSFORMERS_IMPORT_UTILS:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            hidden = "sklearn" not in sys.modules
            if hidden:
                sys.modules["sklearn"] = None  # importlib.util.find_spec("sklearn") -> None
            try:
                module.is_sklearn_available()
            finally:
                if hidden:
                    del sys.modules["sklearn"]

        spec.loader.exec_module = exec_module
        return spec


def lighten_imports() -> None:
    """Install both (once per process; a no-op for transformers when it is already imported)."""
    metadata = importlib.metadata
    if not hasattr(metadata.packages_distributions, "cache_info"):
        metadata.packages_distributions = functools.cache(metadata.packages_distributions)
    if TRANSFORMERS_IMPORT_UTILS not in sys.modules and not any(
            isinstance(finder, _TransformersWithoutSklearn) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TransformersWithoutSklearn())
