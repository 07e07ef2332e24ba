"""Stand-in for the hub's `datasets` in the compatibility runs: GLUE/MRPC-shaped synthetic data (no network).
Sentence pairs whose label is 1 when the first sentence holds the word "same", so a tiny model can learn it."""
import random


class Dataset:
    def __init__(self, columns):
        self._columns = {k: list(v) for k, v in columns.items()}

    @classmethod
    def from_list(cls, rows):
        keys = list(rows[0]) if rows else []
        return cls({k: [r[k] for r in rows] for k in keys})

    @property
    def column_names(self):
        return list(self._columns)

    def __len__(self):
        return len(next(iter(self._columns.values()))) if self._columns else 0

    def __getitem__(self, key):
        if isinstance(key, str):
            return list(self._columns[key])
        if isinstance(key, slice):
            return {k: v[key] for k, v in self._columns.items()}
        return {k: v[key] for k, v in self._columns.items()}

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def map(self, function, batched=False, remove_columns=None, **_):
        out = function(dict(self._columns)) if batched else None
        columns = {k: v for k, v in self._columns.items() if k not in (remove_columns or [])}
        columns.update({k: list(v) for k, v in (out or {}).items()})
        return Dataset(columns)

    def rename_column(self, old, new):
        return Dataset({new if k == old else k: v for k, v in self._columns.items()})

    def unique(self, column):
        return list(dict.fromkeys(self._columns[column]))

    def select(self, indices):
        indices = list(indices)
        return Dataset({k: [v[i] for i in indices] for k, v in self._columns.items()})

    def set_format(self, *args, **kwargs):
        return None


class DatasetDict(dict):
    def map(self, *args, **kwargs):
        return DatasetDict({k: v.map(*args, **kwargs) for k, v in self.items()})

    def rename_column(self, old, new):
        return DatasetDict({k: v.rename_column(old, new) for k, v in self.items()})


_WORDS = "the a cat dog runs sleeps quickly slowly house tree river stone blue red".split()


def _split(n, seed):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = i % 2
        s1 = rng.sample(_WORDS, 5) + (["same"] if label else [])
        rng.shuffle(s1)
        s2 = rng.sample(_WORDS, 5)
        rows.append({"sentence1": " ".join(s1), "sentence2": " ".join(s2), "label": label, "idx": i})
    return Dataset.from_list(rows)


def load_dataset(path, name=None, data_files=None, **_):
    """glue/mrpc (or the test samples' csv): 128/64 rows, or 16/8 for the csv the tests mock with."""
    small = path == "csv"
    train, validation = _split(16 if small else 128, 0), _split(8 if small else 64, 1)
    if small:  # the csv has no idx column
        train, validation = (d.select(range(len(d))) for d in (train, validation))
        for d in (train, validation):
            d._columns.pop("idx")
    return DatasetDict(train=train, validation=validation)


def load_metric(*args, **kwargs):
    import evaluate

    return evaluate.load(*args, **kwargs)
