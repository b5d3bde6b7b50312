"""Build the tokenizer shipped with the kb-nano tiny Llama (tokenizer.json + tokenizer_config.json).

A byte-level BPE with 16384 entries (3 special tokens: <unk>=0, <s>=1, </s>=2), trained with
the Hugging Face `tokenizers` library on the Python standard library's source files of the
interpreter running this script. It exists so vLLM can run the embedded e2e model offline
(vLLM needs a tokenizer; `vllm bench latency` draws token ids below 10000, hence >= 10000
entries). It is not a good tokenizer for any language; only its size and format matter.

    python config/models/kb-nano/tiny-llama/make_tokenizer.py
"""

import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 16384


def main() -> None:
    files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"trained {tok.get_vocab_size()} entries, wanted {VOCAB_SIZE}; use a larger corpus")
    tok.save(str(HERE / "tokenizer.json"))
    (HERE / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 2048,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {HERE / 'tokenizer.json'} ({tok.get_vocab_size()} entries) from {len(files)} files")


if __name__ == "__main__":
    main()
