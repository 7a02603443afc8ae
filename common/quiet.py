"""Keep TensorFlow's C++ start-up chatter (absl, oneDNN, CUDA, cpu_feature_guard) off the terminal.

TF 2.21 prints several lines while `import tensorflow` loads its shared libraries, before absl's
logging is initialised, so no environment variable silences them (checked: TF_CPP_MIN_LOG_LEVEL=3,
GLOG_minloglevel, ABSL_MIN_LOG_LEVEL). `quiet_tensorflow()`, called by each command line before
anything imports TensorFlow, therefore:
- sets TF_CPP_MIN_LOG_LEVEL=3 for what TensorFlow logs once it runs (the failed cuInit on a machine
  without a GPU, the CPU feature notice), unless the user set a level: theirs is kept;
- gives Python its own duplicate of the terminal's stderr, so Python's messages (logging,
  tracebacks, warnings) never depend on file descriptor 2;
- points descriptor 2 at /dev/null only while the `tensorflow` package itself is being imported and
  its devices are listed once (listing them is what tries CUDA, whose failed cuInit on a machine
  without a GPU is an E-line that every level but 3 lets through; `--device-type GPU` on such a
  machine is refused by `common.mesh` with its own message).
The import-time lines go whatever level the user set (the level cannot reach them); `--verbose`, or
TF_CPP_MIN_LOG_LEVEL=0, leaves everything as TensorFlow has it.
Child processes (serving workers, local training clients) inherit the choice.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys
from typing import Iterator, Sequence

_MARK = "SENTIMENT_QUIET_TENSORFLOW"
"""Set in the environment when we chose the log level (so children know it was not the user)."""


def quiet_tensorflow(argv: Sequence[str] | None = None) -> bool:
    """Silence TensorFlow's C++ start-up lines, and its later logs unless the user set
    TF_CPP_MIN_LOG_LEVEL (theirs then decides), all unless `--verbose` is in `argv` or the level is
    0; returns whether the start-up lines are silenced. Call before TensorFlow is imported."""
    argv = sys.argv if argv is None else argv
    verbose = "--verbose" in argv
    user_level = os.environ.get("TF_CPP_MIN_LOG_LEVEL") if os.environ.get(_MARK) != "1" else None
    if verbose or user_level == "0" or "tensorflow" in sys.modules:
        os.environ.pop(_MARK, None)
        if verbose and user_level is None:
            os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)  # inherited from a quiet parent
        return False
    if user_level is None:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        os.environ[_MARK] = "1"
    _detach_python_stderr()
    if not any(isinstance(f, _QuietImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietImport())
    return True


def _detach_python_stderr() -> None:
    """Python writes to a duplicate of fd 2 from now on, so silencing fd 2 never hides its output."""
    if getattr(sys.stderr, "_sentiment_detached", False):
        return
    try:
        fd = os.dup(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):
        return  # no real stderr (embedded, captured): nothing to protect
    sys.stderr.flush()
    stream = os.fdopen(fd, "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")
    stream._sentiment_detached = True  # type: ignore[attr-defined]
    sys.stderr = stream


@contextlib.contextmanager
def _fd2_silenced() -> Iterator[None]:
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec):  # noqa: ANN001, ANN201
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: ANN001
        try:
            with _fd2_silenced():
                self._loader.exec_module(module)
                module.config.list_physical_devices()
        finally:  # from now on the package looks exactly as if imported normally
            module.__loader__ = self._loader
            if module.__spec__ is not None:
                module.__spec__.loader = self._loader

    def __getattr__(self, name: str):  # noqa: ANN204 - get_filename, get_resource_reader, ...
        return getattr(self._loader, name)


class _QuietImport(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` like the normal machinery, then loads it with fd 2 silenced (once)."""

    def find_spec(self, fullname, path, target=None):  # noqa: ANN001, ANN201
        if fullname != "tensorflow":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader)
        return spec
