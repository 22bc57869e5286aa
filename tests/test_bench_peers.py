"""bench/peers.py: the mlx-lm folder exported from a pack for the mlx-lm peer loads with the pack's
weights and keeps the source's chat template."""

import mlx.core as mx
from calibration_packs import CHAT_TEMPLATE, write_byte_tokenizer, write_chat_template

import mlx_flash
from mlx_flash.api import encode_prompt
from mlx_flash.bench.peers import export_mlx_folder
from mlx_flash.pack import write_pack


def test_exported_folder_keeps_the_weights_and_the_chat_template(tiny_llama, tmp_path):
    src = tiny_llama("src", vocab=256)
    write_byte_tokenizer(src)
    write_chat_template(src)
    pack = write_pack(src, tmp_path / "pack", progress=False)
    out = export_mlx_folder(pack, tmp_path / "peer-mlx-model")
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    model, tokenizer = mlx_flash.load(str(out))
    assert encode_prompt(tokenizer, "hi") == tokenizer.encode("<user>hi\n")
    want = dict(mx.load(str(src / "model.safetensors")))
    got = dict(mx.load(str(out / "model.safetensors")))
    assert sorted(got) == sorted(want) and all(mx.array_equal(got[k], want[k]) for k in want)
