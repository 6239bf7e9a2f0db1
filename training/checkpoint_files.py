"""A checkpoint's files on disk: which `step_N` folders exist, whether one is complete (every
file present at its recorded size) and intact (every file's CRC32 as written), and which one a
run starts from.

Where the checksums are verified: a tool reading a whole checkpoint in one process
(`meshtron-hf export`) checks every file first (`resolve_resume`). A training run does not
make every rank re-read the whole checkpoint: before any process group it checks only what
every rank reads anyway, the manifest, the files' sizes and the DCP metadata
(`check_complete`); each rank then verifies the checksum of exactly the data files its own
load plan reads, as it loads them (`VerifyingReader`), and DCP gathers any rank's failure to
every rank, so all ranks raise the same CheckpointError together. `load_newest_intact` walks
the candidates newest first with one such load per candidate: under `resume=auto` a corrupt
newest checkpoint is skipped with a warning naming the file, on every rank in lockstep, and
the previous one loaded; an explicit path that fails is an error.
"""

from __future__ import annotations

import json
import re
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from meshtron.training.distributed import launcher_env

FORMAT = "meshtron-checkpoint"
READABLE_VERSIONS = (1, 2)
META_FILE = "meshtron.json"
DCP_METADATA = ".metadata"
STEP_DIR = re.compile(r"^step_(\d{8})$")
_READ_CHUNK = 8 << 20
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the path/tensor and what to do."""


def describe_os_error(err: OSError) -> str:
    """'<file>: <cause>' for an OSError (the cause alone when it names no file)."""
    cause = err.strerror or str(err)
    return f"{err.filename}: {cause}" if err.filename else cause


def step_folders(root: str | Path) -> list[Path]:
    """Every `step_N` folder under `root`, oldest first, valid or not (`.tmp-step_N/` of a save
    in flight is not one)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in root.iterdir() if (m := STEP_DIR.match(path.name)) and path.is_dir()]
    return [path for _, path in sorted(found)]


def list_checkpoints(root: str | Path) -> list[Path]:
    """Valid checkpoints under `root`, oldest first (invalid or partial folders are left out)."""
    found = []
    for path in step_folders(root):
        try:
            read_meta(path)
        except CheckpointError:
            continue
        found.append(path)
    return found


def read_meta(path: str | Path) -> dict:
    """The checkpoint's `meshtron.json` after checking that every recorded file is complete.
    Raises CheckpointError naming the problem."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    meta_path = path / META_FILE
    if not meta_path.is_file() and ps_servers(path) is not None:
        raise CheckpointError(
            f"{path} is a parameter-server checkpoint (ps_step_N of parallel.dp_mode=ps), not an "
            f"all-reduce one; resume it with parallel.dp_mode=ps parallel.servers={ps_servers(path)} "
            f"checkpoint.resume={path}"
        )
    if not meta_path.is_file():
        raise CheckpointError(
            f"{path} is not a complete meshtron checkpoint (no {META_FILE}: the save did not "
            f"finish); point checkpoint.resume at another step_N folder or delete it"
        )
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_path} is unreadable ({err}); the checkpoint is corrupt, use another") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path} is not a meshtron checkpoint description (format != {FORMAT!r})")
    if meta.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{path}: checkpoint format version {meta.get('version')} is not supported "
            f"(this meshtron reads versions {', '.join(map(str, READABLE_VERSIONS))})"
        )
    for name, entry in meta.get("files", {}).items():
        file = path / name
        size = entry if isinstance(entry, int) else entry["bytes"]
        if not file.is_file():
            raise CheckpointError(
                f"checkpoint {path} is missing its file {name}; the checkpoint is corrupt, use another"
            )
        if file.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint file {file} has {file.stat().st_size} bytes, {size} were written "
                f"(truncated or modified); the checkpoint is corrupt, use another"
            )
    return meta


def ps_servers(path: Path) -> int | None:
    """S when `path` holds a parameter-server checkpoint's `server_s_of_S.pt` files, else None."""
    counts = [int(m.group(1)) for f in path.iterdir() if (m := re.match(r"^server_\d+_of_(\d+)\.pt$", f.name))]
    return max(counts) if counts else None


def file_crc32(path: Path) -> int:
    """CRC32 of the file at `path`, read in 8 MiB chunks."""
    crc, buffer = 0, bytearray(_READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


def check_checkpoint_crcs(path: str | Path) -> dict:
    """`read_meta`, then every file's CRC32 recomputed and compared with the manifest (format
    version 1 has sizes only). Returns the meta; raises CheckpointError naming the first
    corrupt file."""
    path = Path(path)
    meta = read_meta(path)
    for name, entry in sorted(meta.get("files", {}).items()):
        check_file_crc(path, name, entry)
    return meta


def check_file_crc(path: Path, name: str, entry) -> None:
    """Raise CheckpointError naming `path / name` when its CRC32 differs from the manifest's
    `entry` ({"bytes", "crc32"}; a version 1 entry, a bare size, has no checksum)."""
    if isinstance(entry, int):
        return
    try:
        crc = file_crc32(path / name)
    except OSError as err:
        raise CheckpointError(f"checkpoint file {describe_os_error(err)}") from None
    if f"{crc:08x}" != entry["crc32"]:
        raise CheckpointError(
            f"checkpoint file {path / name} is corrupt: its CRC32 is {crc:08x}, "
            f"{entry['crc32']} was written; use another checkpoint"
        )


def check_complete(path: str | Path) -> dict:
    """`read_meta` (every file present at its recorded size), then the checksum of the DCP
    metadata, which every rank reads to plan its load. Returns the meta. The data files'
    checksums are left to the ranks that read them (`VerifyingReader`)."""
    path = Path(path)
    meta = read_meta(path)
    if DCP_METADATA in meta.get("files", {}):
        check_file_crc(path, DCP_METADATA, meta["files"][DCP_METADATA])
    return meta


class VerifyingReader(dcp.FileSystemReader):
    """DCP's file reader that first checks the CRC32 of every file this rank's load plan reads
    against `files` (the manifest's {name: {"bytes", "crc32"}}), raising CheckpointError naming
    the first corrupt one before reading any. `verified`: the names checked, in order."""

    def __init__(self, path: str | Path, files: dict):
        super().__init__(path)
        self.files = files
        self.verified: list[str] = []

    def read_data(self, plan, planner):
        names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        for name in names:
            if name in self.files:
                check_file_crc(Path(self.path), name, self.files[name])
                self.verified.append(name)
        return super().read_data(plan, planner)


def checkpoint_error_in(err: CheckpointException) -> CheckpointError | None:
    """The CheckpointError of the lowest rank whose DCP step raised one (DCP gathers every
    rank's failure to every rank: all ranks get the same one), or None."""
    for rank, (failure, _) in sorted(err.failures.items()):
        if isinstance(failure, CheckpointError):
            return CheckpointError(f"{failure} (found by rank {rank})")
    return None


def warn_checkpoint(message: str) -> None:
    """Print `meshtron: warning: <message>` on global rank 0 (ranks may not have a process group yet)."""
    if launcher_env()[1] == 0:
        print(f"meshtron: warning: {message}", file=sys.stderr, flush=True)


def start_folders(root: str | None, resume: str | None) -> tuple[list[Path], bool]:
    """(the checkpoints a run with `checkpoint.resume=resume` may start from, newest first;
    whether that is one path given explicitly). `resume`: None (no candidates), "auto" (every
    `step_N` folder in `root`), a checkpoint.dir (every `step_N` folder in it: exactly as
    auto) or a checkpoint's path. All `step_N` folders are candidates, not only complete
    ones: a truncated file or a missing manifest is corruption to warn about, never a folder
    to pass over silently."""
    if resume is None:
        return [], False
    if resume == "auto":
        if root is None:
            raise CheckpointError("checkpoint.resume=auto needs checkpoint.dir (where to look for checkpoints)")
        found = step_folders(root)
        ps = sorted(Path(root).glob("ps_step_*")) if not found and Path(root).is_dir() else []
        if ps:
            raise CheckpointError(
                f"{root} holds parameter-server checkpoints ({len(ps)} ps_step_N folder(s)) and no all-reduce one: resume "
                "them with parallel.dp_mode=ps, or give this run another checkpoint.dir"
            )
        return found[::-1], False
    path = Path(resume)
    if STEP_DIR.match(path.name) is None and path.is_dir() and not (path / META_FILE).exists():
        found = step_folders(path)  # a checkpoint.dir given as resume: its newest intact one
        if found:
            return found[::-1], False
        if ps_servers(path) is None and not any(path.glob("ps_step_*")):
            raise CheckpointError(
                f"{path} is neither a checkpoint (no {META_FILE}) nor a folder of step_N checkpoints; "
                f"point checkpoint.resume at a step_N folder or at the checkpoint.dir that holds them"
            )
    return [path], True


def load_newest_intact(candidates: list[Path], load: Callable[[Path], T], *, explicit: bool) -> tuple[Path, T]:
    """(path, load(path)) of the first of `candidates` (newest first) that `load` takes without
    a CheckpointError. An explicit path's error is raised as it is; otherwise each failure is
    skipped with a warning naming it, and none loading is an error. Under a process group
    `load` must fail alike on every rank (DCP's gathered failures do): every rank then takes
    the same candidate."""
    problems = []
    for path in candidates:
        try:
            loaded = load(path)
        except CheckpointError as err:
            if explicit:
                raise
            problems.append(str(err))
            warn_checkpoint(f"skipping checkpoint {path}: {err}")
            continue
        if problems:
            warn_checkpoint(f"resuming from the previous checkpoint {path}")
        return path, loaded
    raise CheckpointError(
        f"no intact checkpoint in {candidates[0].parent} (newest: {problems[0]}); delete the "
        f"corrupt ones or start fresh without checkpoint.resume"
    )


def resolve_resume(root: str | None, resume: str | None) -> Path | None:
    """The checkpoint to start from (`start_folders`), every file verified against its checksum
    (for a process reading the whole checkpoint): the newest intact one, skipping corrupt ones
    with a warning, or an explicit path, which must be intact. None for no resume or an empty
    checkpoint.dir."""
    candidates, explicit = start_folders(root, resume)
    if not candidates:
        return None
    return load_newest_intact(candidates, check_checkpoint_crcs, explicit=explicit)[0]
