"""convert_gguf: a GGUF -> an mlx-lm folder written through model_folder, checked on the embedded
model's conversion (conftest's embedded_model_dir)."""

import json

from mlx_flash.sources.gguf import read_gguf_header


def keys_sorted(doc) -> bool:
    if isinstance(doc, dict):
        return list(doc) == sorted(doc) and all(keys_sorted(v) for v in doc.values())
    if isinstance(doc, list):
        return all(keys_sorted(v) for v in doc)
    return True


def test_converted_folder_holds_weights_config_and_the_rebuilt_tokenizer(embedded_model_dir, embedded_gguf):
    assert sorted(p.name for p in embedded_model_dir.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((embedded_model_dir / "config.json").read_text())
    assert keys_sorted(config)  # as the folder's config has always listed them
    meta = read_gguf_header(embedded_gguf).metadata
    assert config["source"] == {"format": "gguf", "file": embedded_gguf.name}
    assert config["bos_token_id"] == meta["tokenizer.ggml.bos_token_id"]
    assert config["eos_token_id"] == meta["tokenizer.ggml.eos_token_id"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert not list(embedded_model_dir.parent.glob(f".{embedded_model_dir.name}.tmp-*"))
