"""Rows of Hugging Face `datasets`: a directory written by `save_to_disk`, or what `load_dataset`
gives for a local dataset repository or a hub name already in the local cache; never the network.

| input | opened by | a row is named by |
|---|---|---|
| a directory holding `state.json` + `dataset_info.json` (a saved `Dataset`) | `load_from_disk` | `DIR: row N` |
| a directory holding `dataset_dict.json` (a saved `DatasetDict`), with a split | `load_from_disk` | `DIR (split S): row N` |
| `--hf-dataset DIR`: a folder of data files, or a repository with `configs` in its README | `load_dataset` | `hf:DIR (split S): row N` |
| `--hf-dataset NAME`: a hub name | `load_dataset`, offline: the prepared cache (`HF_DATASETS_CACHE`), else a snapshot in the hub cache (`HF_HUB_CACHE`, from `hf download`) | `hf:NAME (split S): row N` |

The hub is never contacted: HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set before `datasets` is
first imported (and its configuration switched to offline if something imported it earlier), and
`datasets` is imported only inside these functions. A `load_dataset` input is prepared into
`HF_DATASETS_CACHE` as `load_dataset` always does (a local repository once, then reused).
Rows are read from the memory-mapped Arrow files BATCH_ROWS at a time, never all at once. This
module gives each row's raw value of the text column; sources.py applies the bad-record rules
(a null or non-string value, a missing column, an empty dataset) exactly as for files. Anything
that cannot be opened or read (a missing split, a damaged save, a name not in the cache) is a
`DataError`: one line naming it and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from cplm_dist.errors import DataError

SAVED_DATASET = ("state.json", "dataset_info.json")
SAVED_DICT = "dataset_dict.json"
BATCH_ROWS = 256


class MissingColumn(DataError):
    """The dataset has no column of the text key (a bad record for sources.py's policy)."""


@dataclass
class DatasetInput:
    """A dataset to read: a save_to_disk directory (`saved`) or a `load_dataset` path or name."""

    source: str
    split: str | None = None
    config: str | None = None
    saved: bool = True
    cache_dir: str | None = None  # load_dataset's cache_dir (default HF_DATASETS_CACHE)
    _dataset: object = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        parts = ([f"config {self.config}"] if self.config else []) + ([f"split {self.split}"] if self.split else [])
        name = self.source if self.saved else f"hf:{self.source}"
        return f"{name} ({', '.join(parts)})" if parts else name


def offline_datasets():
    """The `datasets` module with the hub switched off, its progress bars and warnings quiet."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    import datasets
    from huggingface_hub import constants

    # Read at import: switched here too in case something imported them before the variables were set.
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    constants.HF_HUB_OFFLINE = True
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def saved_kind(path: Path) -> str | None:
    """'dataset' or 'dict' for a directory written by save_to_disk, None for any other directory;
    a directory with some of a save's files but not all is refused (it is not read as records)."""
    if (path / SAVED_DICT).is_file():
        return "dict"
    present = [name for name in SAVED_DATASET if (path / name).is_file()]
    if len(present) == len(SAVED_DATASET):
        return "dataset"
    if present:
        missing = next(name for name in SAVED_DATASET if name not in present)
        raise DataError(f"{path} holds {present[0]} but no {missing}: not a complete datasets save_to_disk "
                        "directory (a damaged save, or a datasets cache directory): save it again with "
                        "save_to_disk, or load it by name with --hf-dataset")
    return None


def _choose_split(label: str, splits: list[str], split: str | None) -> str:
    if split is None:
        raise DataError(f"{label} has splits {', '.join(splits)}: choose one with --split")
    if split not in splits:
        raise DataError(f"{label} has no split '{split}' (splits: {', '.join(splits)}): choose one with --split")
    return split


def saved_input(path: Path, split: str | None) -> DatasetInput:
    """The save_to_disk directory `path`; a DatasetDict's split checked now (from dataset_dict.json,
    without importing datasets), a plain Dataset read whole."""
    if saved_kind(path) == "dataset":
        return DatasetInput(str(path))
    try:
        splits = json.loads((path / SAVED_DICT).read_text(encoding="utf-8"))["splits"]
        if not (isinstance(splits, list) and splits and all(isinstance(s, str) for s in splits)):
            raise ValueError(f"'splits' is {splits!r}, not a list of names")
    except Exception as e:  # noqa: BLE001 - any unreadable dataset_dict.json is a damaged save
        raise DataError(f"{path / SAVED_DICT} cannot be read ({_one_line(e)}): the save is damaged; "
                        "save the DatasetDict again with save_to_disk") from None
    return DatasetInput(str(path), _choose_split(str(path), splits, split))


def hub_input(name: str, config: str | None, split: str | None, cache_dir: str | None = None) -> DatasetInput:
    """`--hf-dataset name [--hf-config config] --split split`, opened now so that a bad name,
    config or split stops before anything is written. A save_to_disk directory is read as such."""
    if not Path(name).is_dir() and (name.startswith(("/", ".", "~")) or name.count("/") > 1):
        raise DataError(f"--hf-dataset {name}: no such directory (and not a hub name, which is NAME or "
                        "NAMESPACE/NAME): check the path")
    if Path(name).is_dir() and saved_kind(Path(name)):
        if config:
            raise DataError(f"{name} is a save_to_disk directory, which has no configs: drop --hf-config")
        return saved_input(Path(name), split)
    inp = DatasetInput(name, split, config, saved=False, cache_dir=cache_dir)
    open_dataset(inp)
    return inp


def _not_cached(inp: DatasetInput) -> DataError:
    from huggingface_hub import constants

    name, cache = inp.source, inp.cache_dir or offline_datasets().config.HF_DATASETS_CACHE
    args = f"'{name}'" + (f", '{inp.config}'" if inp.config else "")
    return DataError(
        f"dataset '{name}' is not in the local cache (HF_DATASETS_CACHE={cache}, "
        f"HF_HUB_CACHE={constants.HF_HUB_CACHE}; the hub is never contacted): where there is network, with the "
        f"same HF_HOME, run python -c \"import datasets; datasets.load_dataset({args})\" once, or hf download "
        f"{name} --repo-type dataset --local-dir DIR and pass --hf-dataset DIR")


def _load(inp: DatasetInput):
    """load_dataset(source, config), all splits: the prepared cache for a hub name, else the
    name's snapshot in the hub cache (a repository downloaded with `hf download`)."""
    datasets = offline_datasets()
    try:
        return datasets.load_dataset(inp.source, inp.config, cache_dir=inp.cache_dir)
    except ConnectionError:  # a hub name, not in the prepared cache
        if Path(inp.source).is_dir():  # a local repository whose files point at the network: no hub name to look up
            raise DataError(f"--hf-dataset {inp.source}: a local dataset repository whose data files need the network "
                            "(the hub is never contacted): download its files into it, or point --input at them") from None
        from huggingface_hub import snapshot_download

        try:
            snapshot = snapshot_download(inp.source, repo_type="dataset")
        except Exception:  # noqa: BLE001 - not in the hub cache either (or not a hub name)
            raise _not_cached(inp) from None
        return datasets.load_dataset(snapshot, inp.config, cache_dir=inp.cache_dir)


def _load_saved(datasets, path: Path):
    """load_from_disk; a saved Dataset of no rows (no Arrow files, which load_from_disk cannot
    open) as an empty Dataset of its columns."""
    state = path / "state.json"
    if saved_kind(path) == "dataset" and json.loads(state.read_text(encoding="utf-8")).get("_data_files") == []:
        features = datasets.DatasetInfo.from_directory(str(path)).features or {}
        return datasets.Dataset.from_dict({name: [] for name in features}, features=features or None)
    return datasets.load_from_disk(str(path))


def open_dataset(inp: DatasetInput):
    """The input's `datasets.Dataset` (opened once); DataError for anything that cannot be opened."""
    if inp._dataset is not None:
        return inp._dataset
    datasets = offline_datasets()
    try:
        if inp.saved:
            ds = _load_saved(datasets, Path(inp.source))
        else:
            ds = _load(inp)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets/pyarrow raise many types for a bad input
        what = "a damaged save_to_disk directory: save it again" if inp.saved else \
            "not a dataset load_dataset can read offline: check the name, --hf-config and the directory's files"
        raise DataError(f"{inp} could not be opened ({_one_line(e)}): {what}") from None
    if isinstance(ds, datasets.DatasetDict):
        inp.split = _choose_split(str(DatasetInput(inp.source, None, inp.config, inp.saved)), list(ds), inp.split)
        ds = ds[inp.split]
    inp._dataset = ds
    return ds


def iter_values(inp: DatasetInput, text_key: str) -> Iterator[tuple[str, object]]:
    """(where, value of the `text_key` column) of every row, in order, BATCH_ROWS at a time."""
    ds = open_dataset(inp)
    if text_key not in ds.column_names:
        raise MissingColumn(f"{inp}: no column '{text_key}' (columns {ds.column_names}); choose one with --text-key")
    row = 0
    try:
        for batch in ds.select_columns([text_key]).with_format("arrow").iter(batch_size=BATCH_ROWS):
            values = batch.column(0).to_pylist()
            for value in values:
                row += 1
                yield f"{inp}: row {row}", value
    except Exception as e:  # noqa: BLE001 - a damaged Arrow file fails while it is read
        raise DataError(f"{inp}: row {row + 1} could not be read ({_one_line(e)}): the dataset's Arrow files "
                        "are damaged; save or load it again") from None
