"""Data for ``shardkit train``: the bundled digits, users' .npz files (and every way they can be
wrong), and the deterministic loader that places batches on the mesh."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardkit.mesh import make_mesh
from shardkit.run import datasets
from shardkit.run.datasets import DataError, Loader


def test_digits_split_is_fixed_and_normalised() -> None:
    ds = datasets.load("digits")
    assert ds.train_images.shape == (1438, 8, 8, 1) and ds.test_images.shape == (359, 8, 8, 1)
    assert ds.classes == 10 and set(np.unique(ds.train_labels)) == set(range(10))
    assert ds.train_images.dtype == np.float32 and ds.train_labels.dtype == np.int32
    assert abs(ds.train_images.mean()) < 1e-5 and abs(ds.train_images.std() - 1) < 1e-3
    again = datasets.load("digits")
    np.testing.assert_array_equal(again.test_labels, ds.test_labels)  # the split is fixed


def test_synthetic_only_by_name() -> None:
    ds = datasets.load("synthetic")
    assert ds.name == "synthetic" and ds.train_images.shape[1:] == (8, 8, 1)


def write(path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


def good(n: int = 20) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "images": rng.integers(0, 256, size=(n, 4, 4, 3), dtype=np.uint8),
        "labels": rng.integers(0, 3, size=n),
    }


def test_npz_uint8_scaled_and_split(tmp_path) -> None:
    ds = datasets.load(write(tmp_path / "d.npz", **good()))
    assert ds.train_images.shape == (16, 4, 4, 3) and ds.test_images.shape == (4, 4, 4, 3)
    assert ds.channels == 3 and ds.image_size == 4


def test_npz_explicit_test_split(tmp_path) -> None:
    arrays = good()
    path = write(tmp_path / "d.npz", **arrays, test_images=arrays["images"][:5],
                 test_labels=np.full(5, 4))  # fmt: skip
    ds = datasets.load(path)
    assert len(ds.train_labels) == 20 and len(ds.test_labels) == 5 and ds.classes == 5


BAD = [
    (lambda a: {"labels": a["labels"]}, "has no array 'images' (it holds labels)"),
    (lambda a: {**a, "images": a["images"][..., 0]}, "images must be 4-D [N, H, W, C]"),
    (lambda a: {**a, "images": a["images"].astype(np.int64)}, "must be float or uint8, got int64"),
    (lambda a: {**a, "images": a["images"][:, :, :2]}, "images must be square"),
    (lambda a: {**a, "labels": a["labels"][:7]}, "20 images but 7 labels"),
    (lambda a: {**a, "labels": a["labels"] - 5}, "labels must be >= 0"),
    (lambda a: {**a, "labels": a["labels"].astype(np.float32)}, "labels must be 1-D integers"),
    (
        lambda a: {**a, "images": np.full((20, 4, 4, 3), np.nan, np.float32)},
        "images holds NaN or infinite values",
    ),
    (lambda a: {**a, "test_images": a["images"]}, "only one of 'test_images' and 'test_labels'"),
]


@pytest.mark.parametrize(("mutate", "message"), BAD)
def test_npz_errors_name_file_and_values(tmp_path, mutate, message) -> None:
    path = write(tmp_path / "bad.npz", **mutate(good()))
    with pytest.raises(DataError, match=r"--data .*bad\.npz") as err:
        datasets.load(path)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_and_malformed_files(tmp_path) -> None:
    with pytest.raises(DataError, match="no such file"):
        datasets.load(str(tmp_path / "absent.npz"))
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(DataError, match=r"is not a readable \.npz file"):
        datasets.load(str(junk))


def test_labels_outside_classes() -> None:
    ds = datasets.load("digits")
    with pytest.raises(DataError, match=r"label 9 is outside \[0, 5\) for classes=5"):
        datasets.check_labels(ds, 5, "--data digits")


def test_loader_epochs_are_permutations_and_deterministic() -> None:
    labels = np.arange(10, dtype=np.int32)
    loader = Loader(np.zeros((10, 1, 1, 1), np.float32), labels, batch=3, seed=7)
    assert loader.steps_per_epoch == 3  # the last partial batch (1 example) is dropped
    epoch0 = np.concatenate([loader.indices(s) for s in range(3)])
    epoch1 = np.concatenate([loader.indices(s) for s in range(3, 6)])
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9
    assert not np.array_equal(epoch0, epoch1) and loader.epoch(5) == 1
    same = Loader(np.zeros((10, 1, 1, 1), np.float32), labels, batch=3, seed=7)
    np.testing.assert_array_equal(same.indices(4), loader.indices(4))
    other = Loader(np.zeros((10, 1, 1, 1), np.float32), labels, batch=3, seed=8)
    assert not np.array_equal(other.indices(0), loader.indices(0))


def test_loader_rejects_a_batch_larger_than_the_data() -> None:
    with pytest.raises(DataError, match="--batch 11 is larger than the 10 training examples"):
        Loader(np.zeros((10, 1, 1, 1), np.float32), np.zeros(10, np.int32), batch=11, seed=0)


def test_batches_land_split_over_data() -> None:
    mesh = make_mesh({"data": 4, "model": 2})
    sharding = NamedSharding(mesh, P("data"))
    images = np.arange(8 * 2, dtype=np.float32).reshape(8, 2, 1, 1)
    loader = Loader(images, np.arange(8, dtype=np.int32), batch=8, seed=0)
    ((x, y),) = loader.batches(0, 1, sharding)
    assert x.sharding == sharding and {s.data.shape for s in x.addressable_shards} == {(2, 2, 1, 1)}
    np.testing.assert_array_equal(np.asarray(y), loader.indices(0))
    np.testing.assert_array_equal(np.asarray(x), images[loader.indices(0)])
    assert datasets.local_rows(sharding, 8) == slice(0, 8)  # one process holds every row
