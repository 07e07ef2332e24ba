"""Stand-in for the hub's `transformers`: a word-level tokenizer and a tiny sequence classifier with BERT's
call signature (ModelOutput with .loss and .logits), the linear warm-up schedule and set_seed."""
import random

import torch
from torch import nn


class BatchEncoding(dict):
    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device):
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                self[k] = v.to(device)
        return self


class _Tokenizer:
    pad_token_id = 0
    pad_token = "[PAD]"
    eos_token = "[SEP]"
    vocab_size = 64

    def _ids(self, text):
        return [1] + [2 + (sum(map(ord, w)) % (self.vocab_size - 2)) for w in text.split()] + [1]

    def __call__(self, first, second=None, truncation=False, max_length=None, padding=False,
                 return_attention_mask=True, **_):
        single = isinstance(first, str)
        firsts = [first] if single else list(first)
        seconds = [second] if single and second is not None else (list(second) if second is not None else None)
        out = {"input_ids": [], "token_type_ids": []}
        for i, a in enumerate(firsts):
            ids_a = self._ids(a)
            ids_b = self._ids(seconds[i])[1:] if seconds is not None else []
            out["input_ids"].append(ids_a + ids_b)
            out["token_type_ids"].append([0] * len(ids_a) + [1] * len(ids_b))
        if padding == "max_length":
            length = max_length or 32
            for key in ("input_ids", "token_type_ids"):
                out[key] = [(x + [0] * length)[:length] for x in out[key]]
        if return_attention_mask:
            out["attention_mask"] = [[1 if t else 0 for t in x] for x in out["input_ids"]]
        return BatchEncoding({k: v[0] for k, v in out.items()} if single else out)

    def pad(self, examples, padding="longest", max_length=None, pad_to_multiple_of=None, return_tensors=None):
        keys = [k for k in examples[0] if k in ("input_ids", "token_type_ids", "attention_mask")]
        longest = max(len(e["input_ids"]) for e in examples)
        if padding == "max_length" and max_length:
            longest = max_length
        if pad_to_multiple_of:
            longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
        batch = {k: torch.tensor([list(e[k]) + [0] * (longest - len(e[k])) for e in examples]) for k in keys}
        for k in examples[0]:
            if k not in keys:
                batch[k] = torch.tensor([e[k] for e in examples])
        return BatchEncoding(batch)


class AutoTokenizer:
    @staticmethod
    def from_pretrained(name, **_):
        return _Tokenizer()


class ModelOutput(dict):
    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class _Classifier(nn.Module):
    def __init__(self, vocab=64, hidden=32, labels=2):
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, hidden, mode="sum")
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, labels))

    def forward(self, input_ids=None, token_type_ids=None, attention_mask=None, labels=None):
        mask = attention_mask if attention_mask is not None else (input_ids != 0).long()
        weights = mask.float()
        logits = self.head(self.embed(input_ids, per_sample_weights=weights / weights.sum(1, keepdim=True)))
        out = ModelOutput(logits=logits)
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
            return ModelOutput(loss=out["loss"], logits=logits)
        return out


class AutoModelForSequenceClassification:
    @staticmethod
    def from_pretrained(name, **_):
        return _Classifier()


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch=-1):
    def factor(step):
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch)


def set_seed(seed):
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass


AdamW = torch.optim.AdamW
