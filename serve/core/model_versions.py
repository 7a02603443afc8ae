"""Model versions on disk -> live versions: discovery, the version policy, loading, status.

A version is an integer subdirectory of a model's base path holding a SavedModel. A poller thread
rescans the directory every `poll_interval_s`:

- a version is a candidate only once it is complete (`saved_model.pb` and the variables index
  present) and settled: its files were last changed more than SETTLE_S ago (an atomic rename of a
  finished export is taken at once), or they did not change across one poll (a `cp -r` still
  copying is left alone until it is done); empty or half-written directories get no status entry;
- the policy picks the versions to serve among candidates; `latest` serves the newest version that
  loads, so a broken newest version falls back to the one before it, at start-up too;
- a new version is loaded and warmed up while the current ones keep serving, then the live set is
  replaced in one assignment; requests hold the `LoadedModel` they resolved, so an unloaded version
  still finishes them;
- status lists what TF Serving reports: the versions the policy serves or is loading, plus the
  last failure of a version still on disk (END, with a plain cause; the details go to the log).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from common.versions import MAX_VERSION, version_number
from serve.config import ServeConfig, VersionPolicy
from serve.core.errors import NotFound, Unavailable
from serve.core.loaded_model import LoadedModel, LoadError

log = logging.getLogger(__name__)

SETTLE_S = 1.0
"""A complete version whose files are older than this is loaded at once (a finished export renamed
into place); a fresher one only once its files stayed the same across one poll."""
RETRIES = 3
"""Load attempts for one unchanged set of files (with growing pauses) before giving up until they change."""
VARIABLES_INDEX = os.path.join("variables", "variables.index")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """One served model: its name, where its versions live, which of them to serve."""

    name: str
    base_path: str
    version_policy: VersionPolicy = "latest"
    versions: tuple[int, ...] = ()
    """Versions to serve with the `specific` policy."""
    version_labels: tuple[tuple[str, int], ...] = ()
    num_latest: int = 1
    """How many of the newest versions the `latest` policy serves (TF Serving's num_versions)."""

    @classmethod
    def from_config(cls, config: ServeConfig) -> "ModelSource":
        return cls(config.model_name, config.model_dir, config.version_policy, config.versions, config.version_labels)


@dataclasses.dataclass
class VersionStatus:
    version: int
    state: str  # START, LOADING, AVAILABLE, UNLOADING, END (TF Serving's ModelVersionStatus.State)
    error_code: str = "OK"
    error_message: str = ""


@dataclasses.dataclass(frozen=True)
class Files:
    """What a version directory holds right now (to tell a finished copy from one in progress)."""

    complete: bool
    count: int
    size: int
    newest_change: float
    """Newest st_ctime of its files: cp -a can backdate mtimes, not ctimes."""
    unreadable: str = ""
    """Why part of the directory could not be read (permissions), or ""."""

    def signature(self) -> tuple:
        return self.count, self.size, self.newest_change, self.unreadable


def scan(version_dir: Path) -> Files:
    """Never raises: a directory this process may not read is reported as `unreadable`."""
    count = size = 0
    newest = 0.0
    errors: list[OSError] = []
    for root, _dirs, files in os.walk(version_dir, onerror=errors.append):
        for name in files:
            try:
                st = os.stat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            except OSError as exc:
                errors.append(exc)
                continue
            count += 1
            size += st.st_size
            newest = max(newest, st.st_ctime, st.st_mtime)
    unreadable = next((exc.strerror or type(exc).__name__ for exc in errors if not isinstance(exc, FileNotFoundError)), "")
    complete = not unreadable and all(
        os.path.isfile(version_dir / name) for name in ("saved_model.pb", VARIABLES_INDEX))
    return Files(complete, count, size, newest, unreadable)


def version_dirs(base_path: str | os.PathLike) -> tuple[dict[int, Path], list[str]]:
    """(version -> directory, names skipped): subdirectories named like TF Serving's versions
    (ASCII digits within int64); hidden and temporary ones are ignored silently, other names are
    returned to be reported. A base path that cannot be listed holds no versions."""
    try:
        entries = sorted(os.scandir(base_path), key=lambda e: e.name)
    except OSError:
        return {}, []
    found: dict[int, Path] = {}
    skipped: list[str] = []
    for entry in entries:
        if entry.name.startswith(".") or not _is_dir(entry):
            continue
        version = version_number(entry.name)
        if version is None:
            skipped.append(entry.name)
        elif version not in found:
            found[version] = Path(entry.path)
        elif entry.name == str(version):  # "7" wins over "07"
            skipped.append(found[version].name)
            found[version] = Path(entry.path)
        else:
            skipped.append(entry.name)
    return found, skipped


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def select_versions(source: ModelSource, candidates: list[int]) -> list[int]:
    """The versions the policy would serve out of `candidates`, in the order to try them (newest
    first). `latest` lists every candidate: the first one that loads is served."""
    ordered = sorted(candidates, reverse=True)
    if source.version_policy == "specific":
        return [v for v in ordered if v in source.versions]
    return ordered


def describe_load_error(exc: BaseException) -> tuple[str, str]:
    """(error code, plain cause) of a failed load, without file paths or TensorFlow internals."""
    if isinstance(exc, LoadError):
        return exc.code, exc.cause
    return "UNKNOWN", f"the SavedModel could not be loaded ({type(exc).__name__})"


class ModelVersions:
    """Live versions of one model. `refresh()` is the only writer; readers never lock."""

    def __init__(
        self,
        source: ModelSource,
        config: ServeConfig,
        on_change: Callable[["ModelVersions"], None] | None = None,
    ) -> None:
        self.source = source
        self.name = source.name
        self.config = config
        self._on_change = on_change
        self._live: dict[int, LoadedModel] = {}
        self._status: dict[int, VersionStatus] = {}
        self._seen: dict[int, Files] = {}  # last scan of each version directory
        self._failed: dict[int, tuple[tuple, int, float]] = {}  # version -> (files, attempts, retry after)
        self._refresh_lock = threading.Lock()
        self._first_pass_done = False
        self._pending = False
        """A complete version is waiting to settle: it may load at the next poll."""
        self._reported: set[str] = set()
        """Directory entries already reported as unusable (each is logged once)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- reading -----------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """A version is live and the first pass over the versions on disk is done (so a server
        with several versions to serve is ready once all of them loaded)."""
        return bool(self._live) and self._first_pass_done

    @property
    def loading(self) -> bool:
        """This model may become ready soon: its first look at the disk is not finished, or a
        complete version is settling. A model with nothing loadable (no base path, only
        broken versions) is not loading: it does not hold the server's readiness back."""
        return not self._first_pass_done or self._pending

    @property
    def live_versions(self) -> list[int]:
        return sorted(self._live)

    def get(self, version: int | None = None, label: str | None = None) -> LoadedModel:
        live = self._live
        if label is not None:
            version = self.label_version(label)
        if version is None:
            if not live:
                raise Unavailable(f"Servable not found for request: Latest({self.name}): no version loaded yet")
            return live[max(live)]
        model = live.get(version)
        if model is None:
            raise NotFound(f"Servable not found for request: Specific({self.name}, {version})")
        return model

    def status(self, version: int | None = None) -> list[VersionStatus]:
        statuses = dict(self._status)
        if version is not None:
            if version not in statuses:
                raise NotFound(f"Could not find version {version} of model {self.name}")
            return [statuses[version]]
        if not statuses:
            raise NotFound(f"Could not find any versions of model {self.name}")
        return [statuses[v] for v in sorted(statuses, reverse=True)]

    def label_version(self, label: str) -> int:
        labels = dict(self.source.version_labels)
        if label not in labels:
            raise NotFound(f"Unrecognized servable version label: {label}")
        return labels[label]

    def update(self, source: ModelSource) -> None:
        """A new policy or labels for the same base path; the next poll applies it."""
        if source != self.source:
            log.info("model %s: new version policy or labels from the config", self.name)
            self.source = source

    # -- loading -----------------------------------------------------------------------------

    def refresh(self, *, settle: bool = True) -> None:
        """One poll: find settled versions, load what the policy wants (warm before going live),
        then unload the rest. `settle=False` takes every complete version as finished (start-up
        without polling)."""
        with self._refresh_lock:
            dirs, skipped = version_dirs(self.source.base_path)
            self._report_skipped(skipped)
            candidates = self._settled(dirs, settle)
            wanted = self._load_wanted(candidates)
            if wanted or not candidates:
                for version in sorted(set(self._live) - wanted):
                    self._unload(version)  # only once what replaces them is live
            self._tidy_status(wanted, dirs)
            self._first_pass_done = True

    def _report_skipped(self, skipped: list[str]) -> None:
        for name in skipped:
            if name not in self._reported:
                self._reported.add(name)
                log.warning("model %s: ignoring %r under its base path: a version directory is named by an integer "
                            "in 0..%d written in ASCII digits", self.name, name, MAX_VERSION)

    def _settled(self, dirs: dict[int, Path], settle: bool) -> list[int]:
        now = time.time()
        settled = []
        seen: dict[int, Files] = {}
        pending = False
        for version, path in dirs.items():
            files = seen[version] = scan(path)
            if files.unreadable:
                key = f"{version}: {files.unreadable}"
                if key not in self._reported:
                    self._reported.add(key)
                    log.warning("model %s version %d: cannot read its directory (%s); skipped until it can be read",
                                self.name, version, files.unreadable)
                continue
            if not files.complete:
                continue
            previous = self._seen.get(version)
            unchanged = previous is not None and previous.signature() == files.signature()
            if version in self._live or not settle or unchanged or now - files.newest_change >= SETTLE_S:
                settled.append(version)
            else:
                pending = True
        self._seen = seen
        self._pending = pending
        return settled

    def _load_wanted(self, candidates: list[int]) -> set[int]:
        """Load the versions the policy wants; returns those now live among them."""
        order = select_versions(self.source, candidates)
        wanted: set[int] = set()
        for version in order:
            if self._stop.is_set():
                break
            if version not in self._live and not self._should_try(version):
                continue
            if version in self._live or self._load(version):
                wanted.add(version)
                if self.source.version_policy == "latest" and len(wanted) >= self.source.num_latest:
                    break  # the newest version(s) that load
        return wanted

    def _should_try(self, version: int) -> bool:
        failed = self._failed.get(version)
        if failed is None:
            return True
        files, attempts, retry_after = failed
        if self._seen[version].signature() != files:
            del self._failed[version]  # the files changed: a fresh start
            return True
        return attempts < RETRIES and time.monotonic() >= retry_after

    def _tidy_status(self, wanted: set[int], dirs: dict[int, Path]) -> None:
        """Keep the versions served or being loaded, and failures of versions still on disk."""
        for version in list(self._status):
            keep = version in wanted or version in self._live or (version in self._failed and version in dirs)
            if not keep:
                del self._status[version]
        for version in list(self._failed):
            if version not in dirs:
                del self._failed[version]

    def _load(self, version: int) -> bool:
        path = Path(self.source.base_path) / str(version)
        self._status[version] = VersionStatus(version, "LOADING")
        log.info("loading model %s version %d from %s", self.name, version, path)
        start = time.perf_counter()
        try:
            monitoring = ((self.config.monitoring_window, self.config.monitoring_window_s)
                          if self.config.monitoring else None)
            model = LoadedModel(self.name, version, path, monitoring)
            calls = model.warm_up(self.config.max_batch_size) if self.config.warmup else 0
        except Exception as exc:  # noqa: BLE001 - a bad version must not stop the server
            self._record_failure(version, path, exc)
            return False
        self._failed.pop(version, None)
        self._live = {**self._live, version: model}  # the atomic switch
        self._status[version] = VersionStatus(version, "AVAILABLE")
        log.info("model %s version %d live after %.2fs (%d warmup calls)",
                 self.name, version, time.perf_counter() - start, calls)
        if self._on_change:
            self._on_change(self)
        return True

    def _record_failure(self, version: int, path: Path, exc: Exception) -> None:
        files = scan(path).signature()
        _, attempts, _ = self._failed.get(version, (files, 0, 0.0))
        attempts += 1
        pause = max(self.config.poll_interval_s, 1.0) * 2 ** attempts
        self._failed[version] = (files, attempts, time.monotonic() + pause)
        code, cause = describe_load_error(exc)
        self._status[version] = VersionStatus(version, "END", code, f"version {version} could not be loaded: {cause}")
        original = exc.__cause__ or exc
        detail = " ".join(f"{cause} ({type(original).__name__}: {original})".split())[:1000]
        retry = "will retry" if attempts < RETRIES else "giving up until its files change"
        log.warning("model %s version %d failed to load (attempt %d, %s): %s", self.name, version, attempts, retry,
                    detail)

    def _unload(self, version: int) -> None:
        self._status[version] = VersionStatus(version, "UNLOADING")
        live = dict(self._live)
        live.pop(version, None)
        self._live = live
        self._status[version] = VersionStatus(version, "END")
        log.info("model %s version %d unloaded", self.name, version)
        if self._on_change:
            self._on_change(self)

    def start(self) -> None:
        """Load in the background now, then poll every `poll_interval_s` (if > 0)."""
        self._thread = threading.Thread(target=self._poll, name=f"poller-{self.name}", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        polling = self.config.poll_interval_s > 0
        warned = False
        while not self._stop.is_set():
            try:
                self.refresh(settle=polling)
                if not self._live and not self._status and not warned:
                    where = self.source.base_path
                    log.warning("model %s: %s; it is not served until a version appears (other models serve on)",
                                self.name, f"no servable versions under {where} yet" if os.path.isdir(where)
                                else f"its base path {where} does not exist")
                    warned = True
            except Exception:  # noqa: BLE001 - keep polling
                log.exception("model poll failed")
            if not polling and self._live:
                return
            self._stop.wait(self.config.poll_interval_s or 1.0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
