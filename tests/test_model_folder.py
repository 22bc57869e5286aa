"""model_folder.py: the one mlx-lm folder writer. A folder written with the embedded model's tokenizer
loads through mlx_flash.load and formats chat prompts as the source does, also when the source keeps
its chat template in chat_template.jinja (as transformers saves it); written whole or not at all."""

import json
import shutil

import mlx.core as mx
import pytest
from conftest import write_tiny_llama

import mlx_flash
from mlx_flash.api import encode_prompt
from mlx_flash.errors import FlashError
from mlx_flash.model_folder import read_config, write_config, write_model_files, write_model_folder
from mlx_flash.models import load_tokenizer


def tiny_weights(tmp_path):
    src = write_tiny_llama(tmp_path / "tiny")
    return dict(mx.load(str(src / "model.safetensors"))), json.loads((src / "config.json").read_text())


@pytest.fixture
def jinja_source(embedded_model_dir, tmp_path):
    """The embedded model's tokenizer files with the chat template moved to chat_template.jinja."""
    src = tmp_path / "jinja-src"
    src.mkdir()
    shutil.copy(embedded_model_dir / "tokenizer.json", src)
    cfg = json.loads((embedded_model_dir / "tokenizer_config.json").read_text())
    (src / "chat_template.jinja").write_text(cfg.pop("chat_template"))
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    return src


@pytest.mark.parametrize("source", ["embedded", "jinja"])
def test_written_folder_loads_and_keeps_the_chat_template(source, embedded_model_dir, jinja_source, tmp_path):
    src = embedded_model_dir if source == "embedded" else jinja_source
    weights, config = tiny_weights(tmp_path)
    out = write_model_folder(tmp_path / "out", weights, config, src)
    model, tokenizer = mlx_flash.load(str(out))
    assert tokenizer.has_chat_template
    want = encode_prompt(load_tokenizer(embedded_model_dir), "What is flash memory?")
    assert encode_prompt(tokenizer, "What is flash memory?") == want
    assert want[:1] == tokenizer.encode("<|im_start|>")  # the template's, not plain text
    got = dict(mx.load(str(out / "model.safetensors")))
    assert sorted(got) == sorted(weights) and all(mx.array_equal(got[k], weights[k]) for k in weights)
    assert json.loads((out / "config.json").read_text()) == config
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_existing_folder_is_refused_unless_replaced(tmp_path):
    weights, config = tiny_weights(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(FlashError, match="--out .*already exists"):
        write_model_folder(out, weights, config, tmp_path, texts={"README.md": "new"})
    write_model_folder(out, weights, config, tmp_path, texts={"README.md": "new"}, replace=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failed_write_leaves_nothing(tmp_path):
    weights, config = tiny_weights(tmp_path)
    with pytest.raises(TypeError):
        write_model_folder(tmp_path / "out", weights, {"bad": object()}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_files_into_a_run_folder_keep_what_is_beside_them(tmp_path):
    weights, config = tiny_weights(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    write_model_files(run, weights, config, tmp_path / "tiny")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.json", "model.safetensors"]


def test_without_a_tokenizer_source_only_weights_and_config_are_written(tmp_path):
    """tokenizer_src=None: the caller writes the tokenizer (sources/gguf_convert rebuilds it)."""
    weights, config = tiny_weights(tmp_path)
    folder = tmp_path / "run"
    folder.mkdir()
    write_model_files(folder, weights, config, None)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((folder / "config.json").read_text()) == config


def test_read_config_returns_what_write_config_wrote(tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "eos_token_id": [1, 2]}
    write_config(tmp_path, config)
    assert read_config(tmp_path) == config
    assert read_config(str(tmp_path)) == config


@pytest.mark.parametrize("text, reason", [
    (None, "missing"),
    ('{"model_type": "llama",', "not JSON"),
    (b"\xff\xfe{}", "not JSON"),
    ('["llama"]', "not a JSON object"),
    ("null", "not a JSON object"),
])
def test_read_config_bad_file_is_one_line_naming_it(tmp_path, text, reason):
    if isinstance(text, bytes):
        (tmp_path / "config.json").write_bytes(text)
    elif text is not None:
        (tmp_path / "config.json").write_text(text)
    with pytest.raises(FlashError) as e:
        read_config(tmp_path)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: {reason}")
    assert "\n" not in message
