"""turbomoe.inference.tiling's tile files (no kernels run): what a write that is refused or fails
leaves behind."""
import json
import os

import pytest
import torch

from turbomoe.inference.tiling import read_tile_file, read_tile_tables, tile_key, write_tile_file


def test_tile_file_write_refused_or_failed_leaves_the_file(tmp_path, monkeypatch):
    """A table or key that the file could not hold is refused before anything is written (an invalid
    tiling written would make read_tile_tables refuse the whole file: every GPU's and model's table);
    a write that fails (a full disk, Ctrl-C) leaves the file as it was and no temporary file."""
    path = str(tmp_path / "tiles.json")
    h200 = tile_key("NVIDIA H200", 128, 8, 2048, 768, torch.bfloat16)
    h100 = tile_key("NVIDIA H100 80GB HBM3", 128, 8, 2048, 768, torch.bfloat16)
    good = {1: ((1, 64, 2, 128, 4, 3, False, True), None)}
    write_tile_file(path, h200, good)
    before = open(path).read()
    for bad, match in (({2: ((16, 24, 1, 64, 4, 2), None)}, r"few_rows_tiles\[2\]: invalid tiling"),
                       ({"x": (None, None)}, r"few_rows_tiles\['x'\]"), ([(None, None)], "must be a dict")):
        with pytest.raises(ValueError, match=match):
            write_tile_file(path, h100, bad)
    with pytest.raises(ValueError, match="key must be a dict"):
        write_tile_file(path, "NVIDIA H100", {8: (None, None)})
    assert open(path).read() == before and read_tile_file(path, h200) == read_tile_file(path, h200) is not None
    # token counts as strings (JSON's keys) beside ints: one entry each, not a TypeError mid-write
    write_tile_file(path, h200, {"1": (None, None), "4": [None, None]})
    assert read_tile_file(path, h200) == {1: (None, None), 4: (None, None)}
    before = open(path).read()

    def full_disk(*args, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(json, "dump", full_disk)
    for key in (h200, h100):
        with pytest.raises(OSError, match="No space left"):
            write_tile_file(path, key, {8: (None, None)})
    assert open(path).read() == before and sorted(os.listdir(tmp_path)) == ["tiles.json"]


def test_tile_file_key_as_tuples(tmp_path):
    """A key made by hand with tuples (tile_key's lists once through JSON) finds the table it wrote,
    and a second write updates that entry rather than adding one the reads never match."""
    path = str(tmp_path / "tiles.json")
    key = {"gpu": "NVIDIA H200", "experts": (128, 8, 2048, 768), "dtype": "bfloat16"}
    write_tile_file(path, key, {1: (None, None)})
    write_tile_file(path, key, {8: (None, None)})
    assert read_tile_file(path, key) == {1: (None, None), 8: (None, None)} == read_tile_file(
        path, tile_key("NVIDIA H200", 128, 8, 2048, 768, torch.bfloat16))
    assert len(read_tile_tables(path)) == 1


def test_tile_file_writers_at_once_keep_both_tables(tmp_path, monkeypatch):
    """Two writers of one tile file at once (processes tuning on two GPUs, here two threads: the second
    starts while the first writes) each keep their table: the second waits for the first, then reads
    what it wrote, rather than being overwritten by it."""
    import threading
    path = str(tmp_path / "tiles.json")
    h200 = tile_key("NVIDIA H200", 128, 8, 2048, 768, torch.bfloat16)
    h100 = tile_key("NVIDIA H100 80GB HBM3", 128, 8, 2048, 768, torch.bfloat16)
    dump, other = json.dump, threading.Thread(target=write_tile_file, args=(path, h100, {8: (None, None)}))

    def dump_while_another_writes(*args, **kw):
        if not other.is_alive() and other.ident is None:  # the first write: the other starts in its midst
            other.start()
            other.join(timeout=0.5)  # it finishes here unless it waits for this write
        return dump(*args, **kw)
    monkeypatch.setattr(json, "dump", dump_while_another_writes)
    write_tile_file(path, h200, {1: (None, None)})
    other.join()
    assert read_tile_file(path, h200) == {1: (None, None)} and read_tile_file(path, h100) == {8: (None, None)}
    assert sorted(os.listdir(tmp_path)) == ["tiles.json"]
