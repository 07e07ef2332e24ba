"""Stand-in for the hub's `evaluate`: GLUE/MRPC's accuracy and F1, computed here."""


class _Metric:
    def __init__(self):
        self.predictions, self.references = [], []

    def add_batch(self, predictions=None, references=None):
        self.predictions += [int(p) for p in predictions.tolist()]
        self.references += [int(r) for r in references.tolist()]

    def compute(self, predictions=None, references=None):
        if predictions is not None:
            self.add_batch(predictions, references)
        p, r = self.predictions, self.references
        self.predictions, self.references = [], []
        tp = sum(1 for a, b in zip(p, r, strict=True) if a == b == 1)
        fp = sum(1 for a, b in zip(p, r, strict=True) if a == 1 and b == 0)
        fn = sum(1 for a, b in zip(p, r, strict=True) if a == 0 and b == 1)
        accuracy = sum(a == b for a, b in zip(p, r, strict=True)) / max(len(p), 1)
        f1 = 2 * tp / max(2 * tp + fp + fn, 1)
        return {"accuracy": accuracy, "f1": f1}


def load(*args, **kwargs):
    return _Metric()
