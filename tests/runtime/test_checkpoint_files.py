"""A checkpoint on disk: at every instant of a save, interrupted anywhere, the newest complete one is found, and the
next save never removes it before a newer one is in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapple.runtime import checkpoint_files as files


def ckpt(path: Path, serial: int | None, legacy: bool = False) -> Path:
    """A stand-in checkpoint: DCP's metadata, a payload naming it, a marker unless ``serial`` is None (incomplete)
    or ``legacy`` (written before markers)."""
    path.mkdir()
    (path / files.DCP_METADATA).write_text("index")
    (path / "payload").write_text(f"serial {serial}")
    if serial is not None and not legacy:
        files.write_mark(path, serial, step=10 * serial)
    return path


def payload(path: Path) -> str:
    return (path / "payload").read_text()


def test_the_newest_complete_checkpoint_is_found_in_every_window(tmp_path):
    p = tmp_path / "ckpt"
    s, r = files.saving(p), files.replaced(p)
    assert files.newest(p) is None
    ckpt(s, None)
    assert files.newest(p) is None and "ckpt.saving holds an incomplete save" in files.missing_message(p)
    ckpt(p, 0, legacy=True)  # a checkpoint from before markers: complete, serial 0
    assert files.newest(p) == files.Found(p, 0, None)
    files.remove(s)
    ckpt(s, 1)  # written and marked, not yet swapped in: the newest
    assert files.newest(p) == files.Found(s, 1, 10)
    files.remove(p)
    ckpt(r, 0)  # no atomic exchange: the old one set aside, the new one not yet moved in
    assert files.newest(p).path == s
    files.remove(r)
    files.remove(s)
    ckpt(p, 2)
    ckpt(s, 1)  # after an atomic exchange, before the old one is removed: the target is newer
    assert files.newest(p).path == p


@pytest.mark.parametrize("atomic", [True, False], ids=["exchange", "two_renames"])
def test_a_save_interrupted_at_each_move_loses_nothing(tmp_path, monkeypatch, atomic):
    if atomic and not files.exchange(ckpt(tmp_path / "a", 0), ckpt(tmp_path / "b", 0)):
        pytest.skip("no atomic exchange of directories here")
    if not atomic:
        monkeypatch.setattr(files, "exchange", lambda a, b: False)
    moves = [files.rename, files.remove]
    for interrupted in range(3):  # the first, second or third move or removal of a swap fails
        root = tmp_path / f"{atomic}{interrupted}"
        root.mkdir()
        p = root / "ckpt"
        ckpt(p, 1)
        ckpt(files.saving(p), 2)
        calls = [0]

        def failing(real):
            def call(*args):
                calls[0] += 1
                if calls[0] == interrupted + 1:
                    raise KeyboardInterrupt("killed")
                return real(*args)
            return call
        monkeypatch.setattr(files, "rename", failing(moves[0]))
        monkeypatch.setattr(files, "remove", failing(moves[1]))
        try:
            files.swap_in(p, files.saving(p))
        except KeyboardInterrupt:
            pass
        monkeypatch.setattr(files, "rename", moves[0])
        monkeypatch.setattr(files, "remove", moves[1])
        found = files.newest(p)
        assert payload(found.path) == "serial 2", (interrupted, found)  # the new one, wherever it is
        assert files.promote(p) == 3  # the next save: the newest moved in place first, the rest cleared
        assert payload(p) == "serial 2" and files.mark(p)["serial"] == 2
        assert sorted(x.name for x in root.iterdir()) == ["ckpt"], interrupted


def test_a_save_never_removes_the_newest_before_a_newer_one_is_in_place(tmp_path):
    p = tmp_path / "ckpt"
    ckpt(files.replaced(p), 4)  # only the set-aside one survived
    assert files.promote(p) == 5 and payload(p) == "serial 4"
    ckpt(files.saving(p), None)  # an interrupted write: removed, the target kept
    assert files.promote(p) == 5 and payload(p) == "serial 4" and not files.saving(p).exists()
    ckpt(files.saving(p), 5)
    files.swap_in(p, files.saving(p))
    assert payload(p) == "serial 5" and sorted(x.name for x in tmp_path.iterdir()) == ["ckpt"]
    ckpt(files.saving(p), 3)  # a stale save older than the target: the target stays
    assert files.promote(p) == 6 and payload(p) == "serial 5"


def test_a_missing_or_truncated_shard_is_named(tmp_path):
    from types import SimpleNamespace as NS

    from torch.distributed.checkpoint.metadata import MetadataIndex as Index
    (tmp_path / "__0_0.distcp").write_bytes(b"x" * 100)
    (tmp_path / "__1_0.distcp").write_bytes(b"x" * 10)
    storage = {Index("a"): NS(relative_path="__0_0.distcp", offset=0, length=100),  # as DCP's metadata has them
               Index("b"): NS(relative_path="__1_0.distcp", offset=0, length=40),
               Index("c"): NS(relative_path="__2_0.distcp", offset=0, length=8)}
    files.check_shards(tmp_path, storage, {"a"}, "rank 0 (stage 0)")
    with pytest.raises(ValueError, match=r"^rank 1 \(stage 1\): damaged checkpoint: .*__1_0.distcp has 10 bytes, its "
                                         r"metadata needs 40 \(truncated\? it holds 'b'\); nothing was loaded$"):
        files.check_shards(tmp_path, storage, {"a", "b"}, "rank 1 (stage 1)")
    with pytest.raises(ValueError, match=r"damaged checkpoint: .*__2_0.distcp is missing \(it holds 'c'\)"):
        files.check_shards(tmp_path, storage, {"c"}, "rank 2 (stage 1)")
