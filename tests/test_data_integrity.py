"""A prepared tokens.bin edited after meshtron-prepare (ids at or above the vocabulary, index.json
unchanged) is refused from the tokens themselves, naming the file and the token offset: a small
file whole at startup (before any process group), a large one window by window as it is read,
every data-parallel rank at the same step (so none waits in a collective for one that failed).
An out-of-range id never reaches the embedding, at tp=1 or tp=2, inside or past the padded
vocabulary."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest
import torch

from meshtron.textdata import data as data_mod
from meshtron.textdata.data import DataError, TokenDataset, build_dataset, first_id_at_or_above, load_prepared
from tests.test_train_cli import TORCHRUN, run

VOCAB = 300  # the tokenizer's; model.vocab_size=300 pads to 384 rows under tp (the padded range)
N_TOKENS = 40_000


def _prepared(directory: pathlib.Path, bad: dict[int, int] | None = None) -> pathlib.Path:
    """A prepared directory of ids < VOCAB with a correct index.json; then `bad` {offset: id}
    written into tokens.bin afterwards (the index and its max_token_id/sha256 untouched)."""
    directory.mkdir()
    ids = (np.arange(N_TOKENS, dtype=np.int64) * 7919 % VOCAB).astype("<u2")
    (directory / "tokens.bin").write_bytes(ids.tobytes())
    index = {
        "format": "meshtron-tokens",
        "version": 1,
        "dtype": "uint16",
        "n_tokens": N_TOKENS,
        "vocab_size": VOCAB,
        "tokenizer": "bpe",
        "max_token_id": int(ids.max()),
    }
    (directory / "index.json").write_text(json.dumps(index))
    if bad:
        edited = np.fromfile(directory / "tokens.bin", dtype="<u2")
        for offset, value in bad.items():
            edited[offset] = value
        edited.tofile(directory / "tokens.bin")
    return directory


class _Data:
    def __init__(self, prepared):
        self.prepared, self.paths, self.max_bytes, self.val_fraction = str(prepared), None, 0, 0.01


# ---------------------------------------------------------------- in process


def test_first_id_at_or_above_scans_in_chunks():
    tokens = np.zeros(1000, dtype="<u2")
    assert first_id_at_or_above(tokens, 1) is None
    tokens[777], tokens[900] = 5, 9
    assert first_id_at_or_above(tokens, 5, chunk=64) == (777, 5)
    assert first_id_at_or_above(tokens, 6, chunk=64) == (900, 9)


def test_startup_scan_names_the_file_and_offset(tmp_path: pathlib.Path, monkeypatch):
    good = _prepared(tmp_path / "good")
    assert build_dataset(_Data(good), 16, 0, VOCAB).vocab_size is None  # scanned whole: no per-read check left
    with monkeypatch.context() as m:
        m.setattr(data_mod, "STARTUP_SCAN_TOKENS", 0)  # too large to scan: every read is checked
        assert build_dataset(_Data(good), 16, 0, VOCAB).vocab_size == VOCAB
    edited = _prepared(tmp_path / "edited", {12_345: 350})  # inside the padded range (300 -> 384)
    assert load_prepared(edited)[1]["max_token_id"] < VOCAB  # the index still vouches for the file
    with pytest.raises(
        DataError,
        match=r"edited/tokens\.bin holds token id 350 at token offset 12345, but its index\.json says vocab_size=300",
    ):
        build_dataset(_Data(edited), 16, 0, 384)


def test_per_read_check_names_the_offset_and_never_returns_the_id(tmp_path: pathlib.Path, monkeypatch):
    monkeypatch.setattr(data_mod, "STARTUP_SCAN_TOKENS", 0)  # a "large" file: checked per read only
    edited = _prepared(tmp_path / "edited", {20_000: 60_000, 39_900: 301})
    ds = build_dataset(_Data(edited), 16, 0, VOCAB)  # nothing read yet
    seen_bad = None
    for first in range(0, 4000, 8):  # one epoch of the train split, batch 8
        try:
            x, y = ds.local_batch_at(first, 8, 0, 1)
        except DataError as err:
            seen_bad = str(err)
            break
        assert int(x.max()) < VOCAB and int(y.max()) < VOCAB
    assert seen_bad is not None and "token offset 20000" in seen_bad and "token id 60000" in seen_bad
    assert "\n" not in seen_bad
    with pytest.raises(DataError, match=r"token id 301 at token offset 39900 \(a window of the val split\)"):
        for index in range(100):
            ds.local_batch(index, 2, 0, 1, split="val")


def test_every_dp_rank_fails_at_the_same_step(tmp_path: pathlib.Path, monkeypatch):
    """Rank 0's rows are clean and rank 1's are not: both raise at that step, the same line."""
    monkeypatch.setattr(data_mod, "STARTUP_SCAN_TOKENS", 0)
    ds = build_dataset(_Data(_prepared(tmp_path / "clean")), 16, 0, VOCAB)
    starts = ds.sample_starts(40, 8).tolist()  # step 5 at batch 8: rank 1 of 2 reads rows 4..7
    offset = starts[6] + 3
    ds = build_dataset(_Data(_prepared(tmp_path / "edited", {offset: 999})), 16, 0, VOCAB)
    for first in range(0, 40, 8):  # steps 0..4 are clean for both ranks
        for rank in (0, 1):
            ds.local_batch_at(first, 8, rank, 2)
    errors = []
    for rank in (0, 1):
        with pytest.raises(DataError) as info:
            ds.local_batch_at(40, 8, rank, 2)
        errors.append(str(info.value))
    assert errors[0] == errors[1] and f"token offset {offset}" in errors[0]
    own = TokenDataset(ds.split_tokens("train"), 16, 0, 0.0, vocab_size=VOCAB)  # only dp=1 reads: no cross-check
    assert int(own.local_batch_at(40, 4, 0, 1)[0].max()) < VOCAB  # rank 0's rows alone are clean


def test_tensor_corpus_without_a_bound_is_unchanged():
    ds = TokenDataset(torch.arange(1000), 8, 0, 0.0)
    assert ds.vocab_size is None and int(ds.local_batch_at(0, 4, 1, 2)[0].max()) < 1000


# ---------------------------------------------------------------- train.py

COMMON = [
    "model.num_layers=1",
    "model.hidden_size=32",
    "model.num_heads=2",
    "model.seq_len=32",
    f"model.vocab_size={VOCAB}",
    "trainer.global_batch_size=4",
    "trainer.max_steps=200",
    "trainer.log_every=50",
    "trainer.eval_every=0",
    "trainer.progress=false",
]

# Runs train.py with STARTUP_SCAN_TOKENS=0, so the per-read check (the path a 1 TB corpus takes) is
# the one exercised.
PER_READ = (
    "import runpy, sys; import meshtron.textdata.data as d; d.STARTUP_SCAN_TOKENS = 0; "
    "sys.argv = ['train.py'] + sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')"
)


def _one_line_error(out, needle: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    lines = [line for line in out.stderr.splitlines() if line.startswith("meshtron: configuration error")]
    assert lines and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.timeout(120)
def test_train_refuses_an_edited_small_file_at_startup(tmp_path: pathlib.Path):
    edited = _prepared(tmp_path / "edited", {12_345: 350})
    out = run([sys.executable, "train.py", *COMMON, f"data.prepared={edited}", f"hydra.run.dir={tmp_path}/run"], 100)
    line = _one_line_error(out, f"{edited}/tokens.bin holds token id 350 at token offset 12345")
    assert "meshtron-prepare" in line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", [350, 5000], ids=["padded-range", "past-the-padding"])
def test_train_tp1_per_read_error_is_one_line_exit_2(tmp_path: pathlib.Path, value: int):
    edited = _prepared(tmp_path / "edited", {30_000: value})
    out = run(
        [sys.executable, "-c", PER_READ, *COMMON, f"data.prepared={edited}", f"hydra.run.dir={tmp_path}/run"], 100
    )
    _one_line_error(out, f"{edited}/tokens.bin holds token id {value} at token offset 30000")
    assert "IndexError" not in out.stderr


@pytest.mark.timeout(150)
def test_train_torchrun_tp2_and_dp2_edited_file_exits_2_on_every_rank(tmp_path: pathlib.Path):
    """tp=2 (the vocab-parallel embedding would mask the id) and dp=2 (each replica reads other
    windows): the per-read check stops both ranks at the same step, one line each, exit 2."""
    edited = _prepared(tmp_path / "edited", {30_000: 350})
    script = tmp_path / "per_read_train.py"
    script.write_text(
        "import runpy, sys\nimport meshtron.textdata.data as d\nd.STARTUP_SCAN_TOKENS = 0\n"
        f"sys.argv[0] = {str(pathlib.Path(__file__).resolve().parents[1] / 'train.py')!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    for layout in (["parallel.tp=2"], ["parallel.tp=1"]):
        out = run(
            [
                *TORCHRUN,
                "--nproc_per_node=2",
                str(script),
                *COMMON,
                *layout,
                f"data.prepared={edited}",
                f"hydra.run.dir={tmp_path}/run_{layout[0][-1]}",
            ],
            140,
            threads=1,
        )
        assert out.returncode != 0, out.stdout[-2000:]
        lines = [line for line in out.stderr.splitlines() if "meshtron: configuration error" in line]
        assert len(lines) == 2, (layout, out.stderr[-3000:])  # both ranks, the same line
        assert all("holds token id 350 at token offset 30000" in line for line in lines), lines
        assert "exitcode  : 2" in out.stderr, out.stderr[-3000:]
        ranks_output = out.stderr.split("elastic/multiprocessing")[0]  # what follows is torchrun's own report
        assert "Traceback" not in ranks_output and "IndexError" not in ranks_output, ranks_output[-3000:]
