"""Build a tiny Llama model directory for CPU serving tests of vLLM and SGLang.

Run with the engines venv's python (it needs ``tokenizers``):

    .venv-engines/bin/python tests/engines/make_model.py OUT_DIR

Writes ``config.json`` (a 4-layer LlamaForCausalLM, hidden 128, vocab 4096),
``generation_config.json``, ``tokenizer.json`` (a byte-level BPE trained here on
this Python's own stdlib sources) and ``tokenizer_config.json`` (with a chat
template). There are no weights: engines start it with ``--load-format dummy``.
Nothing is fetched from a model hub. The output is deterministic: a rerun on the
same machine writes byte-identical files (``--check`` verifies that).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

VOCAB_SIZE = 4096
MAX_LEN = 2048
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\\n' + message['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": MAX_LEN,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "torch_dtype": "bfloat16",
}

GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "do_sample": False}

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
    "add_bos_token": True,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": MAX_LEN,
    "chat_template": CHAT_TEMPLATE,
}


def corpus_files() -> list[str]:
    """A fixed, sorted list of this interpreter's stdlib .py/.txt files (top level + email, json)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for sub in ("", "email", "json", "asyncio", "logging", "http"):
        d = stdlib / sub
        files += [p for p in d.iterdir() if p.is_file() and p.suffix in (".py", ".txt")]
    files = sorted(set(files))
    if len(files) < 50:
        sys.exit(f"make_model: too few stdlib files found under {stdlib}")
    return [str(p) for p in files]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on one concatenated file so worker scheduling cannot change the input order.
    with tempfile.TemporaryDirectory() as td:
        joined = Path(td) / "corpus.txt"
        with open(joined, "w", encoding="utf-8") as out:
            for f in corpus_files():
                out.write(Path(f).read_text(encoding="utf-8", errors="replace"))
                out.write("\n")
        tok.train([str(joined)], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    if tok.get_vocab_size() != VOCAB_SIZE:
        sys.exit(f"make_model: vocab is {tok.get_vocab_size()}, wanted {VOCAB_SIZE}")
    return tok


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.iterdir()):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"), pretty=True)
    write_json(out / "config.json", CONFIG)
    write_json(out / "generation_config.json", GENERATION_CONFIG)
    write_json(out / "tokenizer_config.json", TOKENIZER_CONFIG)
    write_json(out / "special_tokens_map.json",
               {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="model directory to write")
    ap.add_argument("--check", action="store_true",
                    help="also rebuild into a temp dir and fail if the output differs")
    args = ap.parse_args()
    build(args.out)
    d = digest(args.out)
    if args.check:
        with tempfile.TemporaryDirectory() as td:
            build(Path(td))
            if digest(Path(td)) != d:
                print("make_model: output is not deterministic", file=sys.stderr)
                return 1
    enc = json.loads((args.out / "tokenizer.json").read_text())["model"]["vocab"]
    print(f"make_model: wrote {args.out} (vocab {len(enc)}, sha256 {d[:16]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
