"""`meshtron-prepare --tokenizer hf:FOLDER` with each family's tokenizer (issue 39) and with a
folder that has no usable tokenizer (issue 41 item 1).

The folders are the offline stand-ins of tests/hf_tokenizer_folders.py (Llama 3.1 base and
instruct, Qwen2.5 and Qwen3 base and instruct, Mistral v0.3). Each prepared document must be
exactly what transformers' own tokenizer gives for it without special tokens, preceded by BOS
where the family's tokenizer puts BOS first (Llama 3, Mistral) and followed by the base model's
end of text (<|end_of_text|>, <|endoftext|>, </s>), also for instruct folders whose eos_token
ends a chat turn; text that spells a special token stays text.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from meshtron.textdata.data import load_prepared
from meshtron.textdata.prepare import main, prepare
from tests.hf_tokenizer_folders import FAMILIES, no_tokenizer_folder

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

# Every special token the families define, spelled as text inside a document.
LITERAL = (
    "Spelled out, these stay text: <|begin_of_text|> <|end_of_text|> <|eot_id|> <|eom_id|> "
    "<|endoftext|> <|im_start|>user<|im_end|> <s> </s> [INST] [/INST] <unk>.\n"
)
DOCS = {
    "a.txt": "The quick brown fox jumps over the lazy dog.\nDocuments follow one another.\n" * 3,
    "b.py": "def add(a, b):\n    return a + b  # héllo wörld\n" * 4,
    "c.md": "# Notes\n\n" + LITERAL * 2,
    "d.txt": "0123456789 — digits, dashes and ünïcode 😀 never seen in training.\n",
}
ORDER = sorted(DOCS)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("corpus")
    for rel, text in DOCS.items():
        (root / rel).write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build(root / name, **kwargs) for name, (build, kwargs, _, _) in FAMILIES.items()}


def _load(folder: pathlib.Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_documents_are_the_tokenizers_own(family, folders, corpus, tmp_path, capsys):
    _, _, sep, bos = FAMILIES[family]
    folder = folders[family]
    out = tmp_path / "out"
    assert main(["--src", str(corpus), "--out", str(out), "--tokenizer", f"hf:{folder}"]) == 0
    printed = capsys.readouterr().out.splitlines()
    tok = _load(folder)
    eos_id = tok.convert_tokens_to_ids(sep)
    bos_id = None if bos is None else tok.convert_tokens_to_ids(bos)
    tokens, info = load_prepared(out, verify_checksum=True)
    assert (info["eod_token"], info["eos_id"], info["eod_ids"]) == (sep, eos_id, [eos_id])
    assert (info["bos_token"], info["bos_id"]) == (bos, bos_id)
    assert info["tokenizer_eos_token"] == tok.eos_token
    assert info["eos_rule"] == (
        "the tokenizer's eos_token"
        if tok.eos_token == sep
        else f"end of text; the tokenizer's eos_token {tok.eos_token} ends a chat turn"
    )
    assert printed[-1] == (
        f"documents: {'' if bos is None else f'{bos} (id {bos_id}) + '}text + {sep} (id {eos_id}; {info['eos_rule']})"
    )

    want = []
    for doc, rel in zip(info["documents"], ORDER, strict=True):
        assert pathlib.Path(doc["path"]).name == rel
        text = DOCS[rel]
        ids = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if LITERAL not in text:  # no spelled-out special token: exactly tokenizer(doc, add_special_tokens=False)
            assert ids == tok(text, add_special_tokens=False)["input_ids"]
            # ... and BOS is what the tokenizer itself adds (its post-processor / add_bos_token).
            assert tok(text)["input_ids"] == ([] if bos is None else [bos_id]) + ids
        assert len(ids) == doc["length"]
        assert doc["start"] == len(want) + (bos is not None)
        want += ([] if bos is None else [bos_id]) + ids + [eos_id]
    assert np.array_equal(np.asarray(tokens, dtype=np.int64), np.asarray(want))
    # The spelled-out special tokens in c.md stayed text: one separator (and BOS) per document.
    specials = {i for i, added in tok.added_tokens_decoder.items() if added.special}
    assert [int(t) for t in np.asarray(tokens) if int(t) in specials] == (
        [bos_id, eos_id] if bos is not None else [eos_id]
    ) * len(DOCS)
    # The separator is one of the EOS ids the folder's generation_config.json stops on.
    gen_eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    assert eos_id in (gen_eos if isinstance(gen_eos, list) else [gen_eos])


def test_eos_override_and_refusals(folders, corpus, tmp_path, capsys):
    # --eos names the separator (here the chat-turn end a user may want for chat-formatted text).
    folder = folders["llama3_instruct"]
    info = prepare([corpus], tmp_path / "eot", tokenizer=f"hf:{folder}", eos="<|eot_id|>")
    eot = _load(folder).convert_tokens_to_ids("<|eot_id|>")
    assert (info["eod_ids"], info["eos_rule"], info["eod_token"]) == ([eot], "--eos", "<|eot_id|>")

    def refused(args, match):
        out = tmp_path / "refused"
        assert main(["--src", str(corpus), "--out", str(out), *args]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("meshtron-prepare: error: ") and match in err[0], err
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
        return err[0]

    refused(["--tokenizer", f"hf:{folder}", "--eos", "<|nope|>"], "--eos '<|nope|>' is not a token")
    refused(["--tokenizer", "bpe", "--eos", "</s>"], "--eos applies to --tokenizer hf:FOLDER only")
    # An instruct eos (chat-turn end) with no end-of-text token in the vocabulary: say what to set.
    import tokenizers
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.BPE(dict(zip(pre_tokenizers.ByteLevel.alphabet(), range(256))), []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    chat = tmp_path / "chat"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>").save_pretrained(chat)
    line = refused(["--tokenizer", f"hf:{chat}"], "eos_token '<|im_end|>' ends a chat turn")
    assert line.endswith("pass --eos TOKEN (the base model's end of text)")
    assert prepare([corpus], tmp_path / "chat_ok", tokenizer=f"hf:{chat}", eos="<|im_end|>")["eos_rule"] == "--eos"


def test_folder_without_a_usable_tokenizer_exits_2_writing_nothing(corpus, tmp_path, capsys):
    """Issue 41 item 1: a model folder with no tokenizer files used to load as an empty tokenizer
    (transformers builds Qwen2Tokenizer/GPT2Tokenizer from config.json alone) and turn the corpus
    into one end-of-document token per file, exit 0."""

    def refused(folder, match):
        out = tmp_path / "out"
        assert main(["--src", str(corpus), "--out", str(out), "--tokenizer", f"hf:{folder}"]) == 2
        captured = capsys.readouterr()
        err = captured.err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"meshtron-prepare: error: --tokenizer hf:{folder}: "), err
        assert match in err[0], err[0]
        assert captured.out == "" and not out.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    for model_type in ("qwen2", "gpt2", "llama"):
        folder = no_tokenizer_folder(tmp_path / f"model_{model_type}", model_type)
        refused(folder, "has no tokenizer files (tokenizer.json, vocab.json + merges.txt, or tokenizer.model)")
    # Tokenizer files transformers cannot read: one line (its multi-line message folded).
    broken = no_tokenizer_folder(tmp_path / "broken")
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    refused(broken, "transformers cannot load a tokenizer from it")
    spm = no_tokenizer_folder(tmp_path / "spm", "llama")
    (spm / "tokenizer.model").write_bytes(bytes(range(100)))  # not a sentencepiece model
    refused(spm, "transformers cannot load a tokenizer from it")
    # A tokenizer.json with an empty vocabulary: text becomes no tokens.
    import tokenizers
    from tokenizers import models

    empty = tmp_path / "empty_vocab"
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(models.BPE()), eos_token="<|endoftext|>"
    ).save_pretrained(empty)
    refused(empty, "maps text to no tokens")
    # Only an unknown token and byte fallback without byte pieces: every word is <unk>.
    unk_only = tmp_path / "unk_only"
    tok = tokenizers.Tokenizer(models.BPE({"<unk>": 0, "<s>": 1, "</s>": 2}, [], unk_token="<unk>"))
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(unk_only)
    refused(unk_only, "maps every word of a test sentence to its unknown token '<unk>'")
