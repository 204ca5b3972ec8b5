"""Image-classification data for ``shardkit train``: loading, checking, and batches on the mesh.

Sources (``load(source)``):
  ``"digits"``     scikit-learn's bundled handwritten digits (1,797 8×8 grey images, 10 classes,
                   no download); the default.
  ``"synthetic"``  class templates plus noise (learnable, for runs that need no real data).
  ``FILE.npz``     a user's own arrays: ``images`` [N, H, W, C] (float, or uint8 scaled by 1/255)
                   and ``labels`` [N] (integers in [0, classes)); optional ``test_images`` and
                   ``test_labels`` give the test split, else a fixed 20% is held out.

Every split is fixed (seed 0, independent of the training seed), images are normalised with the
TRAIN split's per-channel mean and std, and anything wrong with a file raises ``DataError``, one
sentence naming the file and the values.

Batches: ``Loader`` shuffles the train split once per epoch from ``(seed, epoch)`` (so any step's
batch can be recomputed, e.g. after a restart), drops the last partial batch, and places every
global batch straight onto the mesh with ``jax.make_array_from_process_local_data``: each process
passes only the rows its own devices hold, so the same code feeds several processes.
"""

from __future__ import annotations

import dataclasses
import pathlib
import zipfile
from collections.abc import Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding

TEST_FRACTION = 0.2
SPLIT_SEED = 0  # the train/test split never depends on --seed


class DataError(ValueError):
    """Data that cannot be used (missing file, wrong arrays, bad labels): one sentence why."""


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A normalised classification dataset, split into train and test.

    Attributes:
      name: where it came from ("digits", "synthetic" or the file path).
      train_images, test_images: float32 [N, H, W, C], normalised by the train statistics.
      train_labels, test_labels: int32 [N], in [0, classes).
      classes: the number of classes.
    """

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    classes: int

    @property
    def image_size(self) -> int:
        return self.train_images.shape[1]

    @property
    def channels(self) -> int:
        return self.train_images.shape[3]

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "train": len(self.train_labels),
            "test": len(self.test_labels),
            "image": self.image_size,
            "channels": self.channels,
            "classes": self.classes,
        }


def load(source: str = "digits") -> Dataset:
    """The dataset named by ``source``: "digits", "synthetic" or a path to an ``.npz`` file."""
    if source == "digits":
        return _digits()
    if source == "synthetic":
        return _synthetic()
    return _npz(pathlib.Path(source))


def _digits() -> Dataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise DataError(
            "The default dataset (digits) needs scikit-learn: pip install 'shardkit[train]'."
        ) from err
    digits = load_digits()
    images = digits.images.astype(np.float32)[..., None] / 16.0  # [1797, 8, 8, 1], 0..16 ints
    return _split("digits", images, digits.target.astype(np.int32), classes=10)


def _synthetic(n: int = 2048, image: int = 8, channels: int = 1, classes: int = 10) -> Dataset:
    """Each class a random template; an example is its template plus unit noise."""
    rng = np.random.default_rng(SPLIT_SEED)
    templates = rng.normal(size=(classes, image, image, channels)).astype(np.float32)
    labels = rng.integers(0, classes, size=n).astype(np.int32)
    noise = rng.normal(size=(n, image, image, channels)).astype(np.float32)
    return _split("synthetic", templates[labels] + noise, labels, classes)


def _npz(path: pathlib.Path) -> Dataset:
    where = f"--data {path}"
    if not path.is_file():
        raise DataError(f"{where}: no such file.")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise DataError(f"{where} is not a readable .npz file ({err}).") from err
    missing = [k for k in ("images", "labels") if k not in arrays]
    if missing:
        found = ", ".join(sorted(arrays)) or "nothing"
        raise DataError(f"{where} has no array {missing[0]!r} (it holds {found}).")
    images, labels = _checked(where, "images", "labels", arrays)
    has_test = "test_images" in arrays or "test_labels" in arrays
    classes = int(labels.max()) + 1
    if not has_test:
        return _split(str(path), images, labels, classes)
    if not ("test_images" in arrays and "test_labels" in arrays):
        raise DataError(f"{where} has only one of 'test_images' and 'test_labels'.")
    test_images, test_labels = _checked(where, "test_images", "test_labels", arrays)
    if test_images.shape[1:] != images.shape[1:]:
        raise DataError(
            f"{where}: test_images are {test_images.shape[1:]} but images are {images.shape[1:]}."
        )
    classes = max(classes, int(test_labels.max()) + 1)
    return _normalised(str(path), images, labels, test_images, test_labels, classes)


def _checked(
    where: str, images_key: str, labels_key: str, arrays: dict[str, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """(images float32 [N, H, W, C], labels int32 [N]) after every check a user can fail."""
    images, labels = arrays[images_key], arrays[labels_key]
    if images.ndim != 4:
        raise DataError(
            f"{where}: {images_key} must be 4-D [N, H, W, C], got shape {images.shape}."
        )
    if images.dtype == np.uint8:
        images = images.astype(np.float32) / 255.0
    elif np.issubdtype(images.dtype, np.floating):
        images = images.astype(np.float32)
    else:
        raise DataError(f"{where}: {images_key} must be float or uint8, got {images.dtype}.")
    if images.shape[1] != images.shape[2]:
        raise DataError(f"{where}: {images_key} must be square, got H×W = {images.shape[1:3]}.")
    if not np.isfinite(images).all():
        raise DataError(f"{where}: {images_key} holds NaN or infinite values.")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"{where}: {labels_key} must be 1-D integers, got shape {labels.shape} "
            f"dtype {labels.dtype}."
        )
    if len(labels) != len(images):
        raise DataError(
            f"{where}: {len(images)} {images_key} but {len(labels)} {labels_key}; "
            "counts must match."
        )
    if len(labels) == 0:
        raise DataError(f"{where}: {labels_key} is empty.")
    if labels.min() < 0:
        raise DataError(f"{where}: {labels_key} must be >= 0, found {labels.min()}.")
    return images, labels.astype(np.int32)


def _split(name: str, images: np.ndarray, labels: np.ndarray, classes: int) -> Dataset:
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    n_test = max(1, round(TEST_FRACTION * len(labels)))
    test, train = order[:n_test], order[n_test:]
    if len(train) == 0:
        raise DataError(f"{name}: {len(labels)} examples are too few to split into train and test.")
    return _normalised(name, images[train], labels[train], images[test], labels[test], classes)


def _normalised(
    name: str,
    train_images: np.ndarray,
    train_labels: np.ndarray,
    test_images: np.ndarray,
    test_labels: np.ndarray,
    classes: int,
) -> Dataset:
    mean = train_images.mean(axis=(0, 1, 2), keepdims=True)
    std = train_images.std(axis=(0, 1, 2), keepdims=True) + 1e-6
    return Dataset(
        name,
        ((train_images - mean) / std).astype(np.float32),
        train_labels,
        ((test_images - mean) / std).astype(np.float32),
        test_labels,
        classes,
    )


def check_labels(ds: Dataset, classes: int, where: str) -> None:
    """Raises DataError if any label is outside [0, classes) (``classes`` may be a flag)."""
    top = max(int(ds.train_labels.max()), int(ds.test_labels.max()))
    if top >= classes:
        raise DataError(f"{where}: label {top} is outside [0, {classes}) for classes={classes}.")


# ----------------------------------------------------------------------------- batches


def local_rows(sharding: NamedSharding, global_batch: int) -> slice:
    """The rows of a [global_batch, ...] array that this process's devices hold (contiguous)."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map((global_batch,)).values():
        rows = index[0] if index else slice(None)
        starts.append(rows.start or 0)
        stops.append(global_batch if rows.stop is None else rows.stop)
    return slice(min(starts), max(stops))


@dataclasses.dataclass(frozen=True)
class Loader:
    """Shuffled, fixed-size global batches of a train split, placed on the mesh.

    Step ``s`` of a run reads batch ``s % steps_per_epoch`` of epoch ``s // steps_per_epoch``;
    epoch ``e``'s order is ``default_rng((seed, e)).permutation(N)``. The last partial batch of
    each epoch is dropped.
    """

    images: np.ndarray
    labels: np.ndarray
    batch: int
    seed: int

    def __post_init__(self) -> None:
        if self.batch > len(self.labels):
            raise DataError(
                f"--batch {self.batch} is larger than the {len(self.labels)} training examples."
            )

    @property
    def steps_per_epoch(self) -> int:
        return len(self.labels) // self.batch

    def epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def indices(self, step: int) -> np.ndarray:
        """The example indices of global batch ``step``."""
        order = np.random.default_rng((self.seed, self.epoch(step))).permutation(len(self.labels))
        start = (step % self.steps_per_epoch) * self.batch
        return order[start : start + self.batch]

    def batches(
        self, start: int, stop: int, sharding: NamedSharding
    ) -> Iterator[tuple[jax.Array, ...]]:
        """(images, labels) on the mesh, split per ``sharding``, for steps start..stop-1.

        Each process reads only the rows its own devices hold (``local_rows``)."""
        rows = local_rows(sharding, self.batch)
        for step in range(start, stop):
            idx = self.indices(step)[rows]
            yield tuple(
                jax.make_array_from_process_local_data(sharding, a[idx], (self.batch, *a.shape[1:]))
                for a in (self.images, self.labels)
            )


def place(sharding: NamedSharding, *arrays: np.ndarray) -> tuple[jax.Array, ...]:
    """Global host arrays -> arrays on the mesh; each process contributes only its own rows."""
    rows = local_rows(sharding, len(arrays[0]))
    return tuple(jax.make_array_from_process_local_data(sharding, a[rows], a.shape) for a in arrays)
