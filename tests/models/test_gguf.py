"""GGUF checkpoints, on files the tests write the way llama.cpp's converter does
(gguf_files.py): every storage type dequantised as `gguf` does and as transformers' GGUF
loader does (K-quants as random blocks); Llama's query/key rows put back (GQA: 4 query and
2 KV heads); a tiny Llama's greedy tokens and logprobs from its GGUF equal its safetensors
checkpoint's; the tokenizer from `tokenizer.ggml.*` encodes as the original tokenizer.json,
with llama.cpp's SmolLM pre-tokenizer splitting digits; the chat template, the converter
command and the refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import gguf_name, rotary_pairs, write_gguf
from safetensors.torch import load_file, save_file

from pipeserve.cli import main
from pipeserve.engine.engine import Engine
from pipeserve.models.gguf import convert, find_gguf
from pipeserve.models.gguf.tensors import hf_name
from pipeserve.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(300)

TYPES = {  # one tensor per storage type; rows of 256 values for the K-quants
    "blk.0.ffn_up.weight": Q.Q4_K,
    "blk.0.ffn_gate.weight": Q.Q5_K,
    "blk.0.ffn_down.weight": Q.Q6_K,
    "blk.1.ffn_up.weight": Q.Q8_0,
    "blk.1.ffn_gate.weight": Q.Q4_0,
    "blk.1.ffn_down.weight": Q.Q4_1,
    "blk.0.attn_q.weight": Q.Q8_0,
    "blk.0.attn_k.weight": Q.Q4_K,
    "blk.0.attn_v.weight": Q.F16,
    "blk.0.attn_output.weight": Q.BF16,
    "token_embd.weight": Q.Q6_K,
}
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
TEXTS = ["Hello world!", "  spaces\tand\ttabs\n\nnewlines", "numbers 12345 and 3.14159",
         "unicode: héllo wörld ☃ 日本語", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine("x.gguf") converts into the cache: a throwaway one, not the user's."""
    monkeypatch.setenv("PIPESERVE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def llama(model_dir: Any) -> Path:
    """A tiny GQA Llama wide enough for K-quant rows (256), no rope scaling."""
    return model_dir("tiny-llama", hidden_size=256, intermediate_size=512, head_dim=64,
                     rope_scaling=None, num_hidden_layers=2)


@pytest.fixture(scope="module")
def quantised(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(llama, tmp_path_factory.mktemp("q") / "tiny-q.gguf", TYPES)


@pytest.fixture(scope="module")
def plain(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("f32") / "tiny-f32.gguf"
    return write_gguf(llama, out, chat_template=TEMPLATE)


def converted(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    return load_file(convert(path, tmp / "hf") / "model.safetensors")


def test_dequantised_tensors_equal_gguf_and_transformers(quantised: Path, tmp_path: Path) -> None:
    ours = converted(quantised, tmp_path)
    reader = gguf.GGUFReader(str(quantised))
    seen = set()
    for t in reader.tensors:
        name = hf_name(t.name)
        assert name is not None
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type == Q.BF16:
            bits = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
            expected = torch.from_numpy(bits.view(np.float32).reshape(shape))
        else:
            expected = torch.from_numpy(np.array(
                gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32
            ).reshape(shape))
        if t.name.split(".", 2)[-1] in ("attn_q.weight", "attn_k.weight"):
            heads = 4 if "attn_q" in t.name else 2
            expected = torch.from_numpy(rotary_pairs(ours[name].float().numpy(), heads))
            got = torch.from_numpy(np.array(gguf.quants.dequantize(
                np.asarray(t.data), t.tensor_type), np.float32).reshape(shape))
            assert torch.equal(expected, got), t.name  # ours, re-paired, is the file's
            continue
        assert torch.equal(ours[name].float(), expected), t.name
        seen.add(t.tensor_type)
    assert seen == {*TYPES.values(), Q.F32}  # every storage type checked against gguf

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        str(quantised.parent), gguf_file=quantised.name, dtype=torch.float32
    ).state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor.float(), hf[name].float()), name


def test_query_key_rows_are_put_back_for_gqa(llama: Path, plain: Path, tmp_path: Path) -> None:
    ours = converted(plain, tmp_path)
    original = load_file(llama / "model.safetensors")
    assert set(ours) == set(original)
    for name, tensor in original.items():
        assert torch.equal(ours[name], tensor.float()), name  # F32 file: bitwise
    q = original["model.layers.0.self_attn.q_proj.weight"].float().numpy()
    assert not np.array_equal(rotary_pairs(q, 4), q)  # the file's rows really were reordered


def test_greedy_tokens_of_the_gguf_equal_the_safetensors(llama: Path, plain: Path) -> None:
    ids = [[5, 17, 300, 42, 9, 77, 1, 250], [3, 3, 3, 100, 200]]
    sp = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    flags = {"dtype": "float32", "max_total_tokens": 2048}
    outs = []
    for model in (str(llama), str(plain)):
        with Engine(model, **flags) as engine:
            outs.append(engine.generate(input_ids=ids, sampling_params=sp, return_logprob=True))
    for a, b in zip(*outs, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["output_logprobs"] == b["output_logprobs"]


def test_tokenizer_encodes_as_the_original(llama: Path, plain: Path, tmp_path: Path) -> None:
    out = convert(plain, tmp_path / "hf")
    original, ours = Tokenizer(llama), Tokenizer(out)
    for text in TEXTS:
        assert ours.encode(text) == original.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.token_id("<|im_end|>") == original.token_id("<|im_end|>")
    assert ours.eos_token_ids == (ours.token_id("<|im_end|>"),)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == "[user] hi\n[assistant]"  # the file's template
    assert (out / "chat_template.jinja").read_text() == TEMPLATE


def test_smollm_pre_tokenizer_splits_every_digit(llama: Path, tmp_path: Path) -> None:
    """llama.cpp applies `\\p{N}` before GPT-2's pattern for tokenizer.ggml.pre smollm: no
    piece holds two digits (GPT-2's pattern alone keeps " 2024" whole)."""
    from tokenizers import Tokenizer as HFTokenizer

    path = write_gguf(llama, tmp_path / "smollm.gguf", pre="smollm")
    out = convert(path, tmp_path / "hf")
    text = "in 2024 we had 365 days"
    smollm = HFTokenizer.from_file(str(out / "tokenizer.json")).pre_tokenizer
    gpt2 = HFTokenizer.from_file(str(llama / "tokenizer.json")).pre_tokenizer
    pieces = [p for p, _ in smollm.pre_tokenize_str(text)]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("2024365")
    assert "Ġ2024" in [p for p, _ in gpt2.pre_tokenize_str(text)]
    tok = Tokenizer(out)
    assert tok.decode(tok.encode(text)) == text


def test_engine_takes_a_gguf_file_or_its_directory(plain: Path, tmp_path: Path) -> None:
    assert find_gguf(plain) == plain and find_gguf(plain.parent) == plain
    with Engine(str(plain.parent), dtype="float32", max_total_tokens=512) as engine:
        out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        assert len(out["output_ids"]) == 2
    twice = tmp_path / "two"
    twice.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (twice / name).write_bytes(plain.read_bytes())
    with pytest.raises(ValueError, match="several GGUF files"):
        Engine(str(twice))


def test_convert_command(plain: Path, tmp_path: Path, capsys: Any) -> None:
    main(["convert", str(plain), str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert "wrote" in printed and "config.json" in printed
    # it names the tokenizer only where one was written (a vocabulary it could rebuild)
    assert ("tokenizer.json" in printed) == (tmp_path / "out" / "tokenizer.json").is_file()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] is False and config["head_dim"] == 64
    with pytest.raises(SystemExit, match="pipeserve convert"):
        main(["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "x")])


def test_refusals(llama: Path, tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        convert(tmp_path / "gpt2.gguf", tmp_path / "y")
    scaled = write_gguf(llama, tmp_path / "rope.gguf")
    with_freqs = tmp_path / "freqs.gguf"
    _add_tensor(scaled, with_freqs, "rope_freqs.weight")
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        convert(with_freqs, tmp_path / "z")


def _add_tensor(src: Path, dst: Path, name: str) -> None:
    """A copy of a GGUF file with one more F32 tensor."""
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "llama")
    for key, f in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, f.contents())
        else:
            w.add_key_value(key, f.contents(), f.types[0])
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.add_tensor(name, np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    "extra,what",
    [({}, "pre-tokenizer 'some-new-pre'"),
     ({"tokenizer.ggml.model": "llama"}, "tokenizer model 'llama'")],
)
def test_a_tokenizer_it_cannot_rebuild_leaves_the_model_usable(
    llama: Path, tmp_path: Path, extra: dict, what: str, caplog: Any
) -> None:
    """SentencePiece files, unknown pre-tokenizers: the weights convert, the tokenizer is left
    out with a warning, and --tokenizer-path or --skip-tokenizer-init run the model."""
    path = write_gguf(llama, tmp_path / "odd.gguf", pre="some-new-pre", extra=extra)
    out = convert(path, tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and not (out / "tokenizer.json").exists()
    assert what in caplog.text
    with pytest.raises(FileNotFoundError, match="--tokenizer-path"):
        Engine(str(path), dtype="float32", max_total_tokens=512)
    with Engine(str(path), tokenizer_path=str(llama), dtype="float32",
                max_total_tokens=512) as engine:
        assert engine.generate("hi", sampling_params={"max_new_tokens": 2})["text"] is not None


def test_add_bos_token_puts_the_bos_first(llama: Path, tmp_path: Path) -> None:
    path = write_gguf(llama, tmp_path / "bos.gguf", chat_template=TEMPLATE,
                      extra={"tokenizer.ggml.add_bos_token": True})
    tok = Tokenizer(convert(path, tmp_path / "hf"))
    bos = tok.token_id("<|endoftext|>")
    assert tok.encode("hello")[0] == bos and tok.encode("hello", add_special_tokens=False)[0] != bos
    assert tok.encode_chat([{"role": "user", "content": "x"}]).count(bos) == 0  # no template BOS


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3"])
def test_qwen_ggufs_keep_their_biases_norms_and_row_order(
    model_dir: Any, preset: str, tmp_path: Path
) -> None:
    """Qwen2's q/k/v biases, Qwen3's q/k norms, no rotary-pair reordering (NeoX rope):
    bitwise weights and the same greedy tokens as the safetensors checkpoint."""
    src = model_dir(preset)
    path = write_gguf(src, tmp_path / f"{preset}.gguf")
    ours = converted(path, tmp_path)
    assert any(".bias" in n for n in ours) == (preset == "tiny-qwen2")
    assert any("q_norm" in n for n in ours) == (preset == "tiny-qwen3")
    want, got = runs_as_checkpoint(ours, src, path)
    assert want["output_ids"] == got["output_ids"]


def runs_as_checkpoint(ours: dict[str, torch.Tensor], src: Path, path: Path) -> list[Any]:
    """Asserts the converted tensors `ours` of GGUF `path` are bitwise checkpoint `src`'s;
    the two runs (src's, path's) of a short greedy request, with logprobs."""
    original = load_file(src / "model.safetensors")
    assert set(ours) == set(original)
    for name, tensor in original.items():
        assert torch.equal(ours[name], tensor.float()), name
    sp = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    runs = []
    for model in (str(src), str(path)):
        with Engine(model, dtype="float32", max_total_tokens=512) as engine:
            ids = [4, 8, 15, 16, 23, 42]
            runs.append(engine.generate(input_ids=ids, sampling_params=sp, return_logprob=True))
    return runs


@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q4_0], ids=["q4_1", "q4_0"])
def test_a_q4_gguf_run_in_float32_keeps_its_blocks(model_dir: Any, tmp_path: Path, kind: Q) -> None:
    """The built-in model's kind of file (Q4_1 layers, a Q8_0 embedding tied to the LM head),
    and one with Q4_0 layers (kept as the Q4_1 blocks of the same values),
    run in float32: the native backend keeps the linears in Q4_1 blocks and the shared
    embedding/LM head in Q8_0 (a quarter and about a quarter of their float32 bytes), and
    gives the torch backend's tokens on the dequantised weights, its logprobs where torch's
    GEMM runs and close to them where the blocks kernel does;
    --gguf-weights dequantize holds the dequantised values."""
    from pipeserve.layers.block_quant import Q4_1, Q8_0, block_format
    from pipeserve.layers.embedding import ParallelLMHead
    from pipeserve.layers.linear import LinearBase

    tied = model_dir("tiny-llama", hidden_size=256, intermediate_size=512, head_dim=64,
                     rope_scaling=None, num_hidden_layers=2, tie_word_embeddings=True)
    names = [n for n in load_file(tied / "model.safetensors") if n.endswith("proj.weight")]
    types = {gguf_name(n): kind for n in names} | {"token_embd.weight": Q.Q8_0}
    path = write_gguf(tied, tmp_path / f"{kind.name}.gguf", types)
    prompts = [[(7 * j) % 500 + 1 for j in range(40)], [(3 * j) % 500 + 2 for j in range(9)]]
    sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    runs, held = {}, {}
    for backend, kept in (("native", "keep"), ("torch", "keep"), ("native", "dequantize")):
        flags = {"attention_backend": backend, "gguf_weights": kept}
        with Engine(str(path), dtype="float32", **flags) as engine:
            runner = engine.backend.runner
            held[backend, kept] = runner.param_bytes
            if kept == "dequantize":
                params = runner.model.parameters()
                assert not any(block_format(w) is not None for w in params)
                continue
            if backend == "native":
                if runner.backend.linears.blocks is None:
                    pytest.skip("the native CPU kernels do not build here")
                linear = [m.weight for m in runner.model.modules() if isinstance(m, LinearBase)]
                assert len(linear) == 8 and all(block_format(w) is Q4_1 for w in linear)
                head = [m.weight for m in runner.model.modules() if isinstance(m, ParallelLMHead)]
                assert block_format(head[0]) is Q8_0
                assert runner.model.model.embed_tokens.weight is head[0]
            runs[backend] = engine.generate(
                input_ids=prompts, sampling_params=sp, return_logprob=True
            )
    assert held["native", "keep"] < 0.35 * held["torch", "keep"]
    # the dequantised values, as float32 or, where all of a weight's are float16 numbers (a
    # Q4_0 scale times a small integer, often), as float16: the same values, never blocks
    assert held["native", "dequantize"] <= held["torch", "keep"]
    for got, want in zip(runs["native"], runs["torch"], strict=True):
        assert got["output_ids"] == want["output_ids"]
        # the prompts' 49 rows run torch's GEMM on the exact values; decode steps the blocks
        # kernel, on x rounded to 8 bits (llama.cpp's rounding: tests/kernels/
        # test_block_weights.py; on the built-in model as far from the exact values as
        # llama.cpp, benchmarks/gguf_accuracy.py)
        for key, atol in (("prompt_logprobs", 1e-4), ("output_logprobs", 0.25)):
            a, b = (torch.tensor(r[key], dtype=torch.float64) for r in (got, want))
            torch.testing.assert_close(a, b, atol=atol, rtol=0)


def with_tensors(src: Path, tensors: dict[str, torch.Tensor], out: Path) -> Path:
    """A copy of checkpoint `src` holding `tensors`."""
    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(tensors, out / "model.safetensors")
    return out


@pytest.mark.parametrize("output_bias", [True, False], ids=["four-biases", "llamafied"])
def test_a_llama_gguf_with_attention_biases(
    model_dir: Any, tmp_path: Path, output_bias: bool
) -> None:
    """A Llama GGUF with q/k/v biases converts to transformers' attention_bias Llama: its
    output projection's bias mapped where the file has one (attn_output.bias), else a zero
    one (a "llamafied" Qwen's file: q/k/v only), and runs as the safetensors checkpoint with
    those biases does (tokens and logprobs)."""
    src = model_dir("tiny-llama", attention_bias=True, rope_scaling=None)
    original = load_file(src / "model.safetensors")
    same = {k: v if output_bias or "o_proj.bias" not in k else torch.zeros_like(v)
            for k, v in original.items()}
    reference = with_tensors(src, same, tmp_path / "reference")
    kept = {k: v for k, v in same.items() if output_bias or "o_proj.bias" not in k}
    path = write_gguf(with_tensors(src, kept, tmp_path / "written"), tmp_path / "biased.gguf")
    want, got = runs_as_checkpoint(converted(path, tmp_path), reference, path)
    assert want["output_ids"] == got["output_ids"]
    assert want["prompt_logprobs"] == got["prompt_logprobs"]
