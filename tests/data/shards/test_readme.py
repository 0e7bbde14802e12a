"""The "Streaming from shards" page's snippets (docs/streaming.md) run as written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[3]


def block(lang: str, first_line: str) -> str:
    text = (ROOT / "docs" / "streaming.md").read_text()
    for found in re.findall(rf"```{lang}\n(.*?)```", text, re.S):
        if first_line in found:
            return found
    raise AssertionError(f"docs/streaming.md has no {lang} block with {first_line!r}")


def test_readme_streaming_snippets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    pairs = [(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8), i % 3) for i in range(2500)]
    scope = {"pairs": pairs}
    exec(block("python", "from sailfin.data import ShardWriter"), scope)
    assert len(scope["writer"].shards) == 3
    exec(block("python", "from sailfin import DataInterface"), scope)
    config = yaml.safe_load(block("yaml", "data:\n  class_path: my_recipe.ImageShards"))
    assert set(config["data"]["init_args"]) == {"train_urls", "val_urls"}
    data = scope["ImageShards"](train_urls="data/shards/shard-{000000..000001}.tar",
                                val_urls="data/shards/shard-000002.tar")
    image, label = data.get_train_dataset()[1]
    np.testing.assert_array_equal(image, scope["pairs"][1][0])  # the snippet's own pairs
    assert label == 1 and len(data.get_val_dataset()) == 500
