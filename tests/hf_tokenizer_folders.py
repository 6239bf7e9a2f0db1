"""Offline, tiny stand-ins for the tokenizer folders of the Hugging Face families meshtron imports.

Each builder writes a folder the way the family's own repository lays it out (file names,
`tokenizer_class`, special tokens, which of them is bos / eos, how BOS gets added, a chat
template, `generation_config.json`), with a byte-level or sentencepiece-style BPE trained here
on a few lines of text instead of the real 32k-152k vocabulary. Nothing is downloaded.

- `llama3_folder`: Llama 3.x. A tiktoken-style byte-level BPE saved as `tokenizer.json` for
  `PreTrainedTokenizerFast`; the special tokens are added tokens after the merges' vocabulary
  (`<|begin_of_text|>`, `<|end_of_text|>`, ..., `<|eom_id|>`, `<|eot_id|>`, reserved ones);
  BOS comes from the post-processor (a `TemplateProcessing` "<|begin_of_text|> $A"). Base
  folders have eos `<|end_of_text|>`; instruct ones (3.1) `<|eot_id|>` and a
  generation_config.json whose eos_token_id is the list [end_of_text, eom_id, eot_id].
- `qwen_folder`: Qwen2/2.5 (`version=2`) and Qwen3 (`version=3`): `Qwen2Tokenizer`, NFC +
  the Qwen split regex + byte-level, no BOS at all (`bos_token: null`), eos `<|endoftext|>`
  (base) or `<|im_end|>` (instruct), pad `<|endoftext|>`; Qwen3 adds `<think>` and friends as
  non-special added tokens, as its tokenizer.json does.
- `mistral_folder`: Mistral v0.3: `LlamaTokenizer` (sentencepiece converted to `tokenizer.json`:
  BPE with byte fallback, `<0x00>`..`<0xFF>` byte pieces, Metaspace "▁"), `<unk>` 0, `<s>` 1,
  `</s>` 2, the v0.3 control tokens `[INST]`, `[/INST]`, `[TOOL_CALLS]`, ... after them,
  `add_bos_token: true`, `add_eos_token: false`. (No `tokenizer.model`: `sentencepiece` is not
  installed here; transformers reads `tokenizer.json` first anyway.)
- `no_tokenizer_folder`: a model folder (config.json, no tokenizer files), issue 41 item 1.
"""

from __future__ import annotations

import json
import pathlib

# Text to train the tiny vocabularies on (any text would do; this has words, digits, code).
TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def add(a, b):\n    return a + b  # the sum of two numbers\n" * 4,
    "Documents are separated by the end-of-text token; chat turns end with their own token.\n" * 4,
    "0123456789 + 42 = 1000 - 958; héllo wörld, ünïcode text stays UTF-8.\n" * 3,
]

LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Llama 3.1's first special tokens, in id order from the end of the merges' vocabulary.
LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<|reserved_special_token_3|>",
]
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
QWEN_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Added tokens that are not special in Qwen2.5 / Qwen3's tokenizer.json (special: false).
QWEN2_PLAIN_ADDED = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]
QWEN3_PLAIN_ADDED = [*QWEN2_PLAIN_ADDED, "<think>", "</think>"]
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MISTRAL_SPECIAL = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
]
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + message['content'] + '[/INST]' }}{%- else %}{{- ' ' + message['content'] + eos_token }}"
    "{%- endif %}{%- endfor %}"
)


def _json(path: pathlib.Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _patch_json(path: pathlib.Path, **fields) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(fields)
    _json(path, data)


def _byte_level_bpe(split: str, vocab_size: int, normalizer=None):
    """A tiktoken-style BPE (regex split, then bytes to unicode) trained on TRAIN_TEXT."""
    import tokenizers
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TRAIN_TEXT, trainer=trainer)
    return tok


def llama3_folder(folder: pathlib.Path, instruct: bool = False) -> pathlib.Path:
    """Llama 3.1 (base, or instruct with instruct=True): see the module docstring."""
    import transformers
    from tokenizers import AddedToken, processors

    folder = pathlib.Path(folder)
    tok = _byte_level_bpe(LLAMA3_SPLIT, 320)
    base = tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIAL])
    ids = {t: tok.token_to_id(t) for t in LLAMA3_SPECIAL}
    assert ids["<|begin_of_text|>"] == base  # as in the real file: 128000 = the merges' vocabulary size
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, ids[bos])]
            ),
        ]
    )
    eos = "<|eot_id|>" if instruct else "<|end_of_text|>"
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, model_max_length=131072, clean_up_tokenization_spaces=True
    )
    if instruct:
        fast.chat_template = LLAMA3_CHAT_TEMPLATE
    fast.save_pretrained(folder)
    _patch_json(folder / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast")
    eos_ids = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]] if instruct else ids["<|end_of_text|>"]
    _json(folder / "generation_config.json", {"bos_token_id": ids[bos], "eos_token_id": eos_ids, "do_sample": True})
    _json(
        folder / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "bos_token_id": ids[bos],
            "eos_token_id": eos_ids,
            "vocab_size": tok.get_vocab_size(),
            "max_position_embeddings": 131072,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    )
    return folder


def qwen_folder(folder: pathlib.Path, version: int = 2, instruct: bool = False) -> pathlib.Path:
    """Qwen2/2.5 (version=2) or Qwen3 (version=3), base or instruct: see the module docstring."""
    import transformers
    from tokenizers import AddedToken, normalizers

    folder = pathlib.Path(folder)
    tok = _byte_level_bpe(QWEN_SPLIT, 300, normalizer=normalizers.NFC())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL])
    plain = QWEN3_PLAIN_ADDED if version == 3 else QWEN2_PLAIN_ADDED
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    eos = "<|im_end|>" if instruct else "<|endoftext|>"
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>", model_max_length=131072
    )
    fast.chat_template = QWEN_CHAT_TEMPLATE
    fast.save_pretrained(folder)
    _patch_json(
        folder / "tokenizer_config.json",
        tokenizer_class="Qwen2Tokenizer",
        bos_token=None,
        unk_token=None,
        errors="replace",
        split_special_tokens=False,
        add_prefix_space=False,
    )
    eot = tok.token_to_id("<|endoftext|>")
    eos_ids = [tok.token_to_id("<|im_end|>"), eot] if instruct else eot
    _json(folder / "generation_config.json", {"bos_token_id": eot, "eos_token_id": eos_ids, "pad_token_id": eot})
    _json(
        folder / "config.json",
        {
            "architectures": ["Qwen3ForCausalLM" if version == 3 else "Qwen2ForCausalLM"],
            "model_type": "qwen3" if version == 3 else "qwen2",
            "bos_token_id": eot,
            "eos_token_id": tok.token_to_id(eos),
            "vocab_size": tok.get_vocab_size(),
        },
    )
    return folder


def mistral_folder(folder: pathlib.Path, instruct: bool = False) -> pathlib.Path:
    """Mistral v0.3 (eos `</s>` for base and instruct alike): see the module docstring."""
    import tokenizers
    import transformers
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers

    folder = pathlib.Path(folder)
    # Train the pieces with the sentencepiece-style pre-tokenizer, then lay the vocabulary out as
    # the converted v0.3 tokenizer.json does: control tokens, 256 byte pieces, learned pieces.
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer_tok = tokenizers.Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer_tok.train_from_iterator(
        TRAIN_TEXT, trainer=trainers.BpeTrainer(vocab_size=300, show_progress=False, max_token_length=16)
    )
    learned = json.loads(trainer_tok.to_str())["model"]
    vocab: dict[str, int] = {}
    for t in [*MISTRAL_SPECIAL, *(f"<0x{b:02X}>" for b in range(256))]:
        vocab[t] = len(vocab)
    for t in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL_SPECIAL])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=32768
    )
    if instruct:
        fast.chat_template = MISTRAL_CHAT_TEMPLATE
    fast.save_pretrained(folder)
    _patch_json(
        folder / "tokenizer_config.json",
        tokenizer_class="LlamaTokenizer",
        add_bos_token=True,
        add_eos_token=False,
        legacy=False,
        spaces_between_special_tokens=False,
        use_default_system_prompt=False,
    )
    _json(folder / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})
    _json(
        folder / "config.json",
        {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "vocab_size": tok.get_vocab_size(),
            "sliding_window": None,
        },
    )
    return folder


def no_tokenizer_folder(folder: pathlib.Path, model_type: str = "qwen2") -> pathlib.Path:
    """A model folder without tokenizer files: config.json (and a stub weights file) only."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _json(folder / "config.json", {"model_type": model_type, "vocab_size": 128, "eos_token_id": 2})
    (folder / "model.safetensors").write_bytes(b"")
    return folder


# name -> (builder, kwargs, the document separator prepare must use, the BOS it must put first or None)
FAMILIES = {
    "llama3": (llama3_folder, {}, "<|end_of_text|>", "<|begin_of_text|>"),
    "llama3_instruct": (llama3_folder, {"instruct": True}, "<|end_of_text|>", "<|begin_of_text|>"),
    "qwen2": (qwen_folder, {"version": 2}, "<|endoftext|>", None),
    "qwen2_instruct": (qwen_folder, {"version": 2, "instruct": True}, "<|endoftext|>", None),
    "qwen3": (qwen_folder, {"version": 3}, "<|endoftext|>", None),
    "qwen3_instruct": (qwen_folder, {"version": 3, "instruct": True}, "<|endoftext|>", None),
    "mistral": (mistral_folder, {}, "</s>", "<s>"),
    "mistral_instruct": (mistral_folder, {"instruct": True}, "</s>", "<s>"),
}
