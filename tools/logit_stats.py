"""Distances between two sets of logits (rows: positions, columns: vocabulary)."""
from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_divergence(base: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(base || other) per row: how far other's next-token distribution is from base's."""
    lp, lq = log_softmax(base), log_softmax(other)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """||actual - expected|| / ||expected|| per row."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def top1_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of rows whose argmax is the same."""
    return float(np.mean(np.argmax(a, axis=-1) == np.argmax(b, axis=-1)))
