"""Source trees and checks shared by the single-process and MPI store tests."""

import os

import numpy as np


def make_tree(root, files=120, classes=("cat", "dog", "zebra"), seed=0, max_size=6000):
    """Random small files in class sub-directories (some nested, some empty);
    returns {relative path: bytes}."""
    rng = np.random.default_rng(seed)
    content = {}
    for i in range(files):
        cls = classes[i % len(classes)]
        sub = "nested/" if i % 7 == 0 else ""
        rel = f"{cls}/{sub}{i:05d}.jpg"
        size = 0 if i % 11 == 0 else int(rng.integers(1, max_size))
        content[rel] = rng.bytes(size)
    content["README.txt"] = b"top-level file, no class"
    content["dog/\u00e9t\u00e9 \u6f22\u5b57.jpg"] = b"unicode name"
    for rel, data in content.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
    return content


def check_round_trip(st, content):
    packed = {k: v for k, v in content.items()}
    assert len(st) == len(packed)
    assert list(st.names) == sorted(packed, key=lambda n: n.encode())
    classes = sorted({n.split("/")[0] for n in packed if "/" in n})
    assert st.classes == classes
    assert st.label_map == {c: i for i, c in enumerate(classes)}
    for i, name in enumerate(st.names):
        assert st[i] == packed[name], name
        assert st.size(i) == len(packed[name])
        expected_label = st.label_map[name.split("/")[0]] if "/" in name else -1
        assert st.labels[i] == expected_label, name
        assert st.index_of(name) == i
