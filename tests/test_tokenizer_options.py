"""Tokenizer options: a chat template from chat_template.jinja (as transformers 4.43+ saves
it), from --chat-template (which wins), from tokenizer_config.json, or none (a clear error
instead of a guessed template); --tokenizer-path for a checkpoint without a tokenizer;
--skip-tokenizer-init: token ids in, token ids out, text refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pipeserve.engine.engine import Engine
from pipeserve.models.presets import CHAT_TEMPLATE
from pipeserve.tokenizer import ChatTemplateMissing, Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]
FLAGS: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 1024}


@pytest.fixture(scope="module")
def preset(model_dir: Any) -> Path:
    return model_dir("tiny-qwen3")


def copy_without(src: Path, dst: Path, *names: str) -> Path:
    shutil.copytree(src, dst)
    for name in names:
        (dst / name).unlink()
    return dst


def test_presets_ship_a_chatml_template_as_transformers_saves_it(preset: Path) -> None:
    assert (preset / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    tok = Tokenizer(preset)
    assert tok.chat_template_source.endswith("chat_template.jinja")
    text = tok.apply_chat_template(MESSAGES)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_flag_wins_and_tokenizer_config_is_the_fallback(
    preset: Path, tmp_path: Path
) -> None:
    mine = tmp_path / "mine.jinja"
    mine.write_text("{{ messages[0]['content'] | upper }}!")
    assert Tokenizer(preset, chat_template=mine).apply_chat_template(MESSAGES) == "HI!"
    old = copy_without(preset, tmp_path / "old", "chat_template.jinja")
    config = json.loads((old / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "default:{{ messages|length }}"},
                               {"name": "tool_use", "template": "tools"}]
    (old / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer(old).apply_chat_template(MESSAGES) == "default:1"
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        Tokenizer(preset, chat_template=tmp_path / "missing.jinja")


def test_no_template_is_an_error_not_a_guess(preset: Path, tmp_path: Path) -> None:
    bare = copy_without(preset, tmp_path / "bare", "chat_template.jinja")
    tok = Tokenizer(bare)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateMissing, match="--chat-template FILE"):
        tok.apply_chat_template(MESSAGES)
    assert tok.encode("plain text still works")


def test_tokenizer_path_for_a_checkpoint_without_one(preset: Path, tmp_path: Path) -> None:
    bare = copy_without(preset, tmp_path / "bare", "tokenizer.json", "tokenizer_config.json",
                        "chat_template.jinja")
    with pytest.raises(FileNotFoundError, match="--tokenizer-path DIR .* --skip-tokenizer-init"):
        Engine(str(bare), **FLAGS)
    with Engine(str(bare), tokenizer_path=str(preset), **FLAGS) as engine:
        out = engine.generate("hello", sampling_params={"max_new_tokens": 3, "temperature": 0})
    with Engine(str(preset), **FLAGS) as engine:
        ref = engine.generate("hello", sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert out["output_ids"] == ref["output_ids"] and out["text"] == ref["text"]


def test_skip_tokenizer_init_takes_and_gives_token_ids(preset: Path, tmp_path: Path) -> None:
    bare = copy_without(preset, tmp_path / "bare", "tokenizer.json")
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    with Engine(str(bare), skip_tokenizer_init=True, **FLAGS) as engine:
        assert engine.tokenizer is None
        out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=sp)
        assert out["text"] is None and len(out["output_ids"]) == 4
        with pytest.raises(ValueError, match="give token ids"):
            engine.generate("text", sampling_params=sp)
        with pytest.raises(ValueError, match="stop strings need the tokenizer"):
            engine.generate(input_ids=[5, 6], sampling_params={**sp, "stop": ["x"]})
    with Engine(str(preset), **FLAGS) as engine:
        assert engine.generate(input_ids=[5, 6, 7, 8], sampling_params=sp)["output_ids"] == (
            out["output_ids"]
        )
