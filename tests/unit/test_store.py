"""The HDF5-aggregated small-file store: format, pack, read, bad input,
corruption, crash safety, CLI (packing under 4 MPI ranks: tests/mpi/test_store_mpi.py)."""

import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from hpcdl import _core, store
from hpcdl.errors import CorruptDataError
from hpcdl.store import manifest

from conftest import ROOT
from helpers.store import check_round_trip, make_tree


def hpcdl_cli(*args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "hpcdl", *args], cwd=ROOT, capture_output=True, text=True, timeout=300, **kwargs
    )


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    return src, make_tree(str(src))


# --------------------------------------------------------------------------- checksum


def test_crc32c_known_vectors_and_software_matches_hardware():
    assert store.crc32c(b"123456789") == 0xE3069283
    assert _core.crc32c_software(b"123456789") == 0xE3069283
    assert store.crc32c(b"") == 0
    assert store.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert store.crc32c(b"\xff" * 32) == 0x62A8AB43  # RFC 3720 B.4: 32 bytes of ones
    rng = np.random.default_rng(1)
    for n in list(range(0, 40)) + [1000, 4097, 65536 + 3]:
        data = rng.bytes(n)
        assert store.crc32c(data) == _core.crc32c_software(data), n
        cut = n // 3
        assert store.crc32c(data[cut:], store.crc32c(data[:cut])) == store.crc32c(data)


def test_round_trip_every_byte_name_and_label(tree, tmp_path):
    src, content = tree
    result = store.pack(src, tmp_path / "dst", shards=3, progress=False)
    assert (result.samples, result.shards, result.skipped) == (len(content), 3, [])
    assert result.bytes == sum(len(v) for v in content.values())
    with store.Store(tmp_path / "dst") as st:
        check_round_trip(st, content)
        assert st[-1] == content[st.names[-1]]
        with pytest.raises(IndexError):
            st[len(st)]
        with pytest.raises(KeyError):
            st.index_of("cat/missing.jpg")
        assert st.verify().problems == []


def test_read_many_and_read_into_zero_copy(tree, tmp_path):
    src, content = tree
    store.pack(src, tmp_path / "dst", shards=4, progress=False)
    st = store.Store(tmp_path / "dst", threads=4)
    rng = np.random.default_rng(2)
    idx = rng.integers(0, len(st), size=300)  # random order, with repeats
    data, offsets = st.read_many(idx)
    assert data.dtype == np.uint8 and len(offsets) == len(idx) + 1
    for k, i in enumerate(idx):
        assert data[offsets[k] : offsets[k + 1]].tobytes() == content[st.names[i]]
    out = np.full(int(offsets[-1]) + 10, 7, dtype=np.uint8)
    view, _ = st.read_many(idx, out=out)
    assert np.shares_memory(view, out) and (view == data).all()
    big = max(range(len(st)), key=st.size)
    buf = bytearray(st.size(big) + 5)
    assert st.read_into(big, buf) == st.size(big)
    assert bytes(buf[: st.size(big)]) == content[st.names[big]]
    with pytest.raises(ValueError, match="too small"):
        st.read_into(big, bytearray(st.size(big) - 1))
    empty, offs = st.read_many([])
    assert empty.size == 0 and list(offs) == [0]


def test_format_is_plain_hdf5(tree, tmp_path):
    src, content = tree
    store.pack(src, tmp_path / "dst", shards=2, progress=False)
    with h5py.File(tmp_path / "dst" / store.MANIFEST, "r") as m:
        assert m.attrs["format"] == "hpcdl-store" and m.attrs["format_version"] == store.FORMAT_VERSION
        assert m.attrs["num_samples"] == len(content) and m.attrs["num_shards"] == 2
        shard_files = list(m["shard_files"].asstr()[:])
        assert list(m["shard_first_sample"][:]) == [0, m["shard_num_samples"][0]]
    for name in shard_files:
        with h5py.File(tmp_path / "dst" / name, "r") as f:
            data = f["data"]
            assert data.chunks is None and data.compression is None and data.dtype == np.uint8
            for j, rel in enumerate(f["names"].asstr()[:]):
                a, n = int(f["offsets"][j]), int(f["sizes"][j])
                assert data[a : a + n].tobytes() == content[rel]
                assert int(f["crc32c"][j]) == store.crc32c(content[rel])


def test_order_does_not_depend_on_shard_count(tree, tmp_path):
    src, _ = tree
    store.pack(src, tmp_path / "one", shards=1, progress=False)
    store.pack(src, tmp_path / "many", shards=7, progress=False)
    one, many = store.Store(tmp_path / "one"), store.Store(tmp_path / "many")
    assert list(one.names) == list(many.names) and (one.labels == many.labels).all()
    assert len(many.shard_paths) == 7


def test_fingerprint_names_the_contents_not_the_copy(tree, tmp_path):
    """Equal for copies at other paths and with other shard layouts; another
    for a changed byte, a shorter sample or another label."""
    src, content = tree
    store.pack(src, tmp_path / "one", shards=1, progress=False)
    store.pack(src, tmp_path / "many", shards=7, progress=False)
    fingerprint = store.Store(tmp_path / "one").fingerprint()
    assert len(fingerprint) == 16 and store.Store(tmp_path / "many").fingerprint() == fingerprint
    rel = max(content, key=lambda k: len(content[k]))
    for name, data in (("byte", bytes([content[rel][0] ^ 1]) + content[rel][1:]), ("shorter", content[rel][:-1])):
        changed = tmp_path / f"src-{name}"
        shutil.copytree(src, changed)
        (changed / rel).write_bytes(data)
        store.pack(changed, tmp_path / name, progress=False)
        assert store.Store(tmp_path / name).fingerprint() != fingerprint, name
    relabelled = tmp_path / "label"  # one label changed in the index, its checksum kept right
    shutil.copytree(tmp_path / "one", relabelled)
    with h5py.File(relabelled / store.shard_name(0, 1), "r+") as f:
        labels = f["labels"][:]
        labels[0] += 1
        f["labels"][:] = labels
        f["labels"].attrs["crc32c"] = np.uint32(manifest._index_crc(labels))
    assert store.Store(relabelled).fingerprint() != fingerprint


def test_store_survives_pickle_and_fork(tree, tmp_path):
    src, content = tree
    store.pack(src, tmp_path / "dst", shards=2, progress=False)
    st = store.Store(tmp_path / "dst", threads=3)
    st.read_many(range(len(st)))  # the parent's thread pool exists before the fork
    clone = pickle.loads(pickle.dumps(st))
    assert clone[5] == st[5]
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()

    def child():
        data, offsets = st.read_many(range(len(st)))
        queue.put(data.tobytes() == b"".join(content[n] for n in st.names))

    proc = ctx.Process(target=child)
    proc.start()
    ok = queue.get(timeout=60)
    proc.join(60)
    assert ok and proc.exitcode == 0


# --------------------------------------------------------------------------- bad input


def test_bad_entries_are_skipped_and_reported(tree, tmp_path):
    src, content = tree
    os.symlink("..", src / "cat" / "loop")  # a loop back to the root
    os.symlink("selfloop", src / "cat" / "selfloop")  # ELOOP on stat
    os.symlink("missing.jpg", src / "dog" / "dangling")
    os.mkfifo(src / "dog" / "fifo")
    with open(os.path.join(os.fsencode(src), b"zebra", b"bad\xffname.jpg"), "wb") as fh:
        fh.write(b"not valid utf-8")
    os.symlink(src / "cat" / "00003.jpg", src / "zebra" / "link.jpg")  # a file symlink is packed
    result = store.pack(src, tmp_path / "dst", progress=False)
    reasons = dict(result.skipped)
    assert reasons["cat/loop"].startswith("symlink loop")
    assert reasons["cat/selfloop"] == "symlink loop"
    assert reasons["dog/dangling"] == "dangling symlink"
    assert reasons["dog/fifo"] == "not a regular file"
    assert "not valid UTF-8" in reasons["zebra/bad\\xffname.jpg"]
    assert len(result.skipped) == 5
    st = store.Store(tmp_path / "dst")
    assert sorted(st.skipped) == sorted(result.skipped)
    content["zebra/link.jpg"] = content["cat/00003.jpg"]
    check_round_trip(st, content)
    assert st[st.index_of("cat/nested/00000.jpg")] == b""  # zero-byte files are valid empty samples


def test_file_vanishing_between_listing_and_reading_is_skipped(tree, tmp_path, monkeypatch):
    src, content = tree
    real_list = store.packing._list_source

    def list_then_delete(*args):
        files, skipped = real_list(*args)
        os.remove(src / "dog" / "00001.jpg")
        with open(src / "cat" / "00003.jpg", "ab") as fh:
            fh.write(b"grown")
        return files, skipped

    monkeypatch.setattr(store.packing, "_list_source", list_then_delete)
    result = store.pack(src, tmp_path / "dst", shards=2, progress=False)
    reasons = dict(result.skipped)
    assert sorted(reasons) == ["cat/00003.jpg", "dog/00001.jpg"], reasons
    assert reasons["dog/00001.jpg"] == "vanished before it was read"
    assert reasons["cat/00003.jpg"].startswith("changed while packing")
    del content["dog/00001.jpg"], content["cat/00003.jpg"]
    check_round_trip(store.Store(tmp_path / "dst"), content)


def test_unreadable_file_is_skipped(tmp_path):
    src = tmp_path / "src"
    content = make_tree(str(src), files=12)
    os.chmod(src / "cat" / "00003.jpg", 0)
    # Root reads anything: drop the capabilities that let it (setpriv, util-linux).
    prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    proc = subprocess.run(
        prefix + [sys.executable, "-m", "hpcdl", "pack", str(src), str(tmp_path / "dst"), "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "1 file(s) skipped" in proc.stderr
    assert "cat/00003.jpg: unreadable (permission denied)" in proc.stdout + proc.stderr
    del content["cat/00003.jpg"]
    check_round_trip(store.Store(tmp_path / "dst"), content)


def test_empty_source_and_missing_source(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds no files to pack"):
        store.pack(tmp_path / "empty", tmp_path / "dst", progress=False)
    os.symlink("nowhere", tmp_path / "empty" / "sub" / "dangling")
    with pytest.raises(ValueError, match=r"1 entries skipped.*dangling"):
        store.pack(tmp_path / "empty", tmp_path / "dst", progress=False)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        store.pack(tmp_path / "nope", tmp_path / "dst", progress=False)
    assert not (tmp_path / "dst" / store.MANIFEST).exists()


def test_existing_destination_needs_force(tree, tmp_path):
    src, content = tree
    dst = tmp_path / "dst"
    store.pack(src, dst, shards=2, progress=False)
    before = (dst / store.MANIFEST).stat().st_mtime_ns
    with pytest.raises(FileExistsError, match="already holds a packed store"):
        store.pack(src, dst, progress=False)
    assert (dst / store.MANIFEST).stat().st_mtime_ns == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an hpcdl store"):
        store.pack(src, foreign, progress=False)
    result = store.pack(src, dst, shards=3, force=True, progress=False)
    assert result.shards == 3 and result.reused_shards == 0
    assert sorted(p.name for p in dst.iterdir()) == [store.MANIFEST] + [store.shard_name(k, 3) for k in range(3)]
    check_round_trip(store.Store(dst), content)


def test_pack_inside_source_does_not_pack_itself(tree):
    src, content = tree
    store.pack(src, src / "packed", progress=False)
    check_round_trip(store.Store(src / "packed"), content)


# --------------------------------------------------------------------------- corruption


def test_flipped_byte_is_caught_on_read_and_by_verify(tree, tmp_path):
    src, content = tree
    dst = tmp_path / "dst"
    store.pack(src, dst, shards=2, progress=False)
    st = store.Store(dst)
    victim = max(range(len(st)), key=st.size)
    shard = st.shard_paths[int(np.searchsorted(st.shard_first, victim, side="right")) - 1]
    with h5py.File(shard, "r") as f:
        local = victim - int(st.shard_first[st.shard_paths.index(shard)])
        at = f["data"].id.get_offset() + int(f["offsets"][local]) + 17
    with open(shard, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x40]))
    st = store.Store(dst)
    with pytest.raises(CorruptDataError) as err:
        st[victim]
    message = str(err.value)
    assert shard in message and f"sample {victim}" in message and st.names[victim] in message
    with pytest.raises(CorruptDataError, match=f"sample {victim} "):
        st.read_many([0, victim, 1])
    with pytest.raises(CorruptDataError):
        st.read_into(victim, bytearray(st.size(victim)))
    assert st[victim - 1] == content[st.names[victim - 1]]  # the neighbours are intact
    report = st.verify()
    assert [(i, n) for i, n, _ in report.problems] == [(victim, st.names[victim])]
    assert "checksum mismatch" in report.problems[0][2]
    proc = hpcdl_cli("verify", str(dst), "-q")
    assert proc.returncode == 1 and "FAILED: 1 bad sample" in proc.stdout and st.names[victim] in proc.stdout


def flip_bit(path, name, item=0):
    """Flip one bit of item `item` of data set `name` in an HDF5 file: in the
    file's raw bytes for numbers, through h5py for strings (their bytes live in
    a heap, the data set holds references)."""
    with h5py.File(path, "r+") as f:
        ds = f[name]
        if h5py.check_string_dtype(ds.dtype):
            text = bytearray(ds[item])
            text[0] ^= 0x01
            ds[item] = bytes(text).decode("utf-8")
            return
        at = ds.id.get_offset() + item * ds.dtype.itemsize
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x01]))


SHARD_INDEX = ("offsets", "sizes", "crc32c", "labels", "names")
MANIFEST_INDEX = (
    "shard_files",
    "shard_first_sample",
    "shard_num_samples",
    "shard_data_bytes",
    "label_names",
    "skipped_names",
    "skipped_reasons",
)


@pytest.mark.parametrize("dataset", SHARD_INDEX)
def test_flipped_bit_in_a_shard_index_is_named_at_open(tree, tmp_path, dataset):
    src, _ = tree
    dst = tmp_path / "dst"
    store.pack(src, dst, shards=2, progress=False)
    shard = dst / store.shard_name(1, 2)
    flip_bit(shard, dataset, item=1)
    with pytest.raises(CorruptDataError) as err:
        store.Store(dst)
    assert f"shard '{shard}'" in str(err.value) and f"index data set '{dataset}'" in str(err.value)
    proc = hpcdl_cli("verify", str(dst), "-q")
    assert proc.returncode == 1 and shard.name in proc.stdout and f"'{dataset}'" in proc.stdout, proc.stdout


@pytest.mark.parametrize("dataset", MANIFEST_INDEX)
def test_flipped_bit_in_the_manifest_is_named_at_open(tmp_path, dataset):
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(str(src), files=40)
    os.symlink("missing", src / "dangling")  # something skipped, so the skipped lists are not empty
    store.pack(src, dst, shards=2, progress=False)
    flip_bit(dst / store.MANIFEST, dataset)
    with pytest.raises(CorruptDataError, match=f"index data set '{dataset}' of manifest '.*{store.MANIFEST}'"):
        store.Store(dst)
    proc = hpcdl_cli("verify", str(dst), "-q")
    assert proc.returncode == 1 and f"'{dataset}'" in proc.stderr


def test_store_without_index_checksums_opens_with_a_warning(tree, tmp_path):
    src, content = tree
    dst = tmp_path / "dst"
    store.pack(src, dst, shards=2, progress=False)
    for path in [dst / store.MANIFEST] + [dst / store.shard_name(k, 2) for k in range(2)]:
        with h5py.File(path, "r+") as f:  # as packed by hpcdl before format version 2
            f.attrs["format_version"] = 1
            for name in f:
                f[name].attrs.pop("crc32c", None)
    with pytest.warns(store.StoreWarning, match="without index checksums.*re-pack"):
        st = store.Store(dst)
    check_round_trip(st, content)


def test_truncated_shard_is_named(tree, tmp_path):
    src, content = tree
    dst = tmp_path / "dst"
    store.pack(src, dst, shards=3, progress=False)
    shard = dst / store.shard_name(1, 3)
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size // 2)
    with pytest.raises(CorruptDataError, match=f"shard '{shard}' cannot be used.*samples \\d+\\.\\.\\d+ are lost"):
        store.Store(dst)
    st = store.Store(dst, allow_damaged=True)
    lo, n = int(st.shard_first[1]), int(st.shard_counts[1])
    with pytest.raises(CorruptDataError, match=f"sample {lo} .*{shard.name}"):
        st[lo]
    assert st[0] == content[st.names[0]]
    report = st.verify()
    assert report.problems == [] and len(report.damaged) == 1
    assert report.damaged[0][:3] == (str(shard), lo, n) and "truncated" in report.damaged[0][3]
    proc = hpcdl_cli("verify", str(dst), "-q")
    assert proc.returncode == 1 and f"FAILED: {n} bad sample(s)" in proc.stdout
    assert len([line for line in proc.stdout.splitlines() if shard.name in line]) == 1
    assert [line for line in proc.stdout.splitlines() if shard.name in line] == [
        line for line in proc.stdout.splitlines() if line.startswith(f"  {shard.name}: {n} samples from {lo}: ")
    ]
    proc = hpcdl_cli("ls", str(dst))
    assert proc.returncode == 1 and f"{shard.name} is damaged" in proc.stderr
    total = sum(len(v) for v in content.values())
    assert f"bytes: {total} " in proc.stdout and f"{shard.name}  samples {lo}..{lo + n - 1}" in proc.stdout


def test_verify_json(tree, tmp_path):
    import json

    src, content = tree
    dst = tmp_path / "dst"
    store.pack(src, dst, shards=3, progress=False)
    proc = hpcdl_cli("verify", str(dst), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    total = sum(len(v) for v in content.values())
    assert (out["samples"], out["shards"], out["ok"], out["bad"], out["problems"]) == (
        len(content),
        3,
        len(content),
        0,
        [],
    )
    assert out["bytes_read"] >= total and isinstance(out["seconds"], float) and out["seconds"] > 0
    st = store.Store(dst)
    victim = max(range(int(st.shard_counts[0])), key=st.size)  # in shard 0, which starts at sample 0
    flip_bit(st.shard_paths[0], "data", item=int(st.shard_infos[0]["offsets"][victim]))
    shard2 = dst / store.shard_name(2, 3)
    with open(shard2, "r+b") as fh:
        fh.truncate(shard2.stat().st_size // 2)
    proc = hpcdl_cli("verify", str(dst), "--json")
    out = json.loads(proc.stdout)
    lost = int(st.shard_counts[2])
    assert proc.returncode == 1 and out["bad"] == 1 + lost and out["ok"] == len(content) - 1 - lost
    first, second = out["problems"]
    assert first["shard"] == store.shard_name(0, 3) and first["first"] == victim and first["samples"] == 1
    assert first["name"] == st.names[victim] and "checksum mismatch" in first["reason"]
    assert second["shard"] == shard2.name and second["samples"] == lost and "truncated" in second["reason"]
    proc = hpcdl_cli("verify", str(tmp_path / "nothing"), "--json")
    assert proc.returncode == 1 and "no hpcdl store" in json.loads(proc.stdout)["error"]


def test_shard_truncated_after_open_is_caught_on_read(tree, tmp_path):
    src, content = tree
    dst = tmp_path / "dst"
    store.pack(src, dst, shards=1, progress=False)
    st = store.Store(dst)
    with h5py.File(st.shard_paths[0], "r") as f:
        data_end = f["data"].id.get_offset() + f["data"].shape[0]
    with open(st.shard_paths[0], "r+b") as fh:
        fh.truncate(data_end - 1)
    report = st.verify()
    bad = [p[0] for p in report.problems]
    assert bad and all("truncated" in p[2] for p in report.problems)
    with pytest.raises(CorruptDataError, match="truncated"):
        st[bad[0]]


# --------------------------------------------------------------------------- crash safety


def test_killed_pack_leaves_no_manifest_and_rerun_completes(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    content = make_tree(str(src), files=3000, max_size=400)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcdl", "pack", str(src), str(dst), "--shards", "40", "--threads", "1", "-q"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if dst.is_dir() and any(p.name.startswith("shard-") for p in dst.iterdir()):
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "packing finished before it could be killed"
    assert not (dst / store.MANIFEST).exists()
    with pytest.raises(FileNotFoundError, match="missing manifest.h5"):
        store.Store(dst)
    complete = sorted(p.name for p in dst.iterdir() if p.name.startswith("shard-"))
    for name in complete:  # a shard under its final name is always whole
        with h5py.File(dst / name, "r") as f:
            assert f.attrs["complete"] == 1
    result = store.pack(src, dst, shards=40, progress=False)
    assert result.reused_shards == len(complete) >= 1
    assert not [p for p in dst.iterdir() if p.name.endswith(".tmp")]
    check_round_trip(store.Store(dst), content)


def test_second_pack_into_one_destination_is_refused(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    content = make_tree(str(src), files=3000, max_size=400)
    first = subprocess.Popen(
        [sys.executable, "-m", "hpcdl", "pack", str(src), str(dst), "--shards", "40", "--threads", "1", "-q"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        lock = dst / ".hpcdl-pack.lock"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and first.poll() is None and not (lock.exists() and lock.stat().st_size):
            time.sleep(0.002)
        assert first.poll() is None and lock.exists(), "the first pack took no lock while it ran"
        os.killpg(first.pid, signal.SIGSTOP)  # holds the lock, mid-run, for as long as the test needs
        second = hpcdl_cli("pack", str(src), str(dst), "--shards", "40", "-q")
        assert second.returncode == 1 and "another hpcdl pack is writing to" in second.stderr
        assert f"pid {first.pid} on host" in second.stderr, second.stderr
        mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
        ranks = subprocess.run(
            [mpiexec, "-n", "2", sys.executable, "-m", "hpcdl", "pack", str(src), str(dst), "-q"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ranks.returncode != 0 and f"pid {first.pid} on host" in ranks.stderr, ranks.stderr
        os.killpg(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 0 and "packed 3002 samples" in out, err
    assert not lock.exists()
    check_round_trip(store.Store(dst), content)


def test_lock_of_a_dead_pack_is_taken_over_and_another_hosts_is_not(tree, tmp_path):
    src, content = tree
    dst = tmp_path / "dst"
    dst.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = dst / ".hpcdl-pack.lock"
    lock.write_text(f"{socket.gethostname()} {dead.pid} {time.time()}")
    store.pack(src, dst, shards=2, progress=False)
    assert not lock.exists()
    check_round_trip(store.Store(dst), content)
    lock.write_text(f"other-host.example 4242 {time.time()}")
    with pytest.raises(FileExistsError, match="pid 4242 on host other-host.example.*delete"):
        store.pack(src, dst, shards=2, progress=False, force=True)
    assert lock.exists()  # not ours to remove
    check_round_trip(store.Store(dst), content)


def test_rerun_with_other_shard_count_drops_stale_shards(tree, tmp_path):
    src, content = tree
    dst = tmp_path / "dst"
    store.pack(src, dst, shards=5, progress=False)
    os.remove(dst / store.MANIFEST)  # as if the first run died before its manifest
    result = store.pack(src, dst, shards=2, progress=False)
    assert result.reused_shards == 0
    assert sorted(p.name for p in dst.iterdir()) == [store.MANIFEST, store.shard_name(0, 2), store.shard_name(1, 2)]
    check_round_trip(store.Store(dst), content)


# --------------------------------------------------------------------------- CLI


def test_cli_pack_ls_verify(tree, tmp_path):
    src, content = tree
    dst = tmp_path / "dst"
    proc = hpcdl_cli("pack", str(src), str(dst), "--shards", "2")
    assert proc.returncode == 0, proc.stderr
    assert f"packed {len(content)} samples" in proc.stdout and "into 2 shards" in proc.stdout
    assert "packing" in proc.stderr and "files/s" in proc.stderr  # the progress bar
    proc = hpcdl_cli("pack", str(src), str(dst))
    assert proc.returncode == 1 and "--force" in proc.stderr
    proc = hpcdl_cli("pack", str(src), str(dst), "--force", "--shard-bytes", "100K", "-q")
    assert proc.returncode == 0, proc.stderr
    total = sum(len(v) for v in content.values())
    assert f"into {-(-total // 102400)} shards" in proc.stdout
    proc = hpcdl_cli("ls", str(dst))
    assert proc.returncode == 0, proc.stderr
    assert f"samples: {len(content)}" in proc.stdout
    for cls in ("cat", "dog", "zebra"):
        count = sum(1 for n in content if n.startswith(cls + "/"))
        assert f"  {cls}  {count}" in proc.stdout
    proc = hpcdl_cli("verify", str(dst))
    assert proc.returncode == 0 and "OK: every checksum matches" in proc.stdout
    proc = hpcdl_cli("verify", str(tmp_path / "nothing"))
    assert proc.returncode == 1 and "no hpcdl store" in proc.stderr


def test_cli_pack_under_mpiexec(tree, tmp_path):
    src, content = tree
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    proc = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, "-m", "hpcdl", "pack", str(src), str(tmp_path / "dst"), "--shards", "3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "with 2 rank(s)" in proc.stdout
    check_round_trip(store.Store(tmp_path / "dst"), content)


def test_a_closed_store_says_so(tree, tmp_path):
    src, _ = tree
    store.pack(src, tmp_path / "dst", progress=False)
    st = store.Store(tmp_path / "dst")
    st.close()
    for use in (
        len,
        lambda s: s[0],
        lambda s: s.read_many([0]),
        lambda s: s.read_into(0, bytearray(1 << 20)),
        lambda s: s.verify(),
    ):
        with pytest.raises(ValueError, match="is closed"):
            use(st)
    assert "closed" in repr(st)


@pytest.mark.parametrize(
    "option", [["--shards", "0"], ["--shards", "-3"], ["--threads", "-5"], ["--threads", "0"], ["--shards", "two"]]
)
def test_pack_rejects_counts_below_one(tree, tmp_path, option):
    src, _ = tree
    proc = hpcdl_cli("pack", str(src), str(tmp_path / "dst"), "-q", *option)
    assert proc.returncode == 2 and f"{option[0]} must be a positive integer, got" in proc.stderr, proc.stderr
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("setting", [{"shards": 0}, {"shards": -3}, {"threads": -5}, {"threads": 2.5}])
def test_pack_api_rejects_counts_below_one(tree, tmp_path, setting):
    src, _ = tree
    with pytest.raises(ValueError, match=f"{next(iter(setting))} must be a positive integer"):
        store.pack(src, tmp_path / "dst", progress=False, **setting)
    assert not (tmp_path / "dst" / "manifest.h5").exists()
