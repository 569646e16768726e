import json
from pathlib import Path

from posttrain.data.prepared import local_view


def test_local_directory_is_returned_as_is(tmp_path):
    assert local_view(str(tmp_path)) == str(tmp_path)


def test_remote_view_copies_manifest_and_tokenizer_but_not_shards(s3, tmp_path):
    root = f"prepared-{tmp_path.name}"
    shard = s3.put(f"{root}/train/chat/part-00000.parquet", b"not read here")
    manifest = {"sources": [{"split": "train", "name": "chat", "shards": [{"uri": shard}]}]}
    s3.put(f"{root}/manifest.json", json.dumps(manifest).encode())
    s3.put(f"{root}/tokenizer/tokenizer.json", b"{}")
    view = Path(local_view(s3.uri(root), cache_dir=str(tmp_path / "cache")))
    assert json.loads((view / "manifest.json").read_text()) == manifest
    assert (view / "tokenizer" / "tokenizer.json").read_text() == "{}"
    assert not (view / "train").exists()
    # unchanged manifest: the same view; a changed one: refreshed in place
    assert local_view(s3.uri(root), cache_dir=str(tmp_path / "cache")) == str(view)
    manifest["sources"][0]["name"] = "chat2"
    s3.put(f"{root}/manifest.json", json.dumps(manifest).encode())
    again = Path(local_view(s3.uri(root), cache_dir=str(tmp_path / "cache")))
    assert again == view and json.loads((again / "manifest.json").read_text()) == manifest
