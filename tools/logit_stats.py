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


# ---- llama-perplexity's --kl-divergence statistics (innerq-perplexity prints the same) ----

def kld_from_codes(lo: np.ndarray, code: np.ndarray, lp: np.ndarray, nats: float) -> np.ndarray:
    """KL(base || lp) per row, the base decoded from innerq-perplexity's 16-bit codes as
    tools/perplexity.c does: log p_i = lo + code_i * nats / 65535, renormalized, so with
    e_i = exp(log p_i) and S = sum e_i, KL = sum e_i (log p_i - lp_i) / S - log S."""
    lb = np.asarray(lo, dtype=np.float64)[..., None] + (nats / 65535) * np.asarray(code, dtype=np.float64)
    e = np.exp(lb)
    s = e.sum(axis=-1)
    return (e * (lb - lp)).sum(axis=-1) / s - np.log(s)


def _mean_unc(x: np.ndarray) -> tuple[float, float]:
    """The mean and the uncertainty of the mean (0 for 10 values or fewer)."""
    n = len(x)
    f = float(x.sum() / n)
    var = float((x * x).sum() / n - f * f)
    return f, (np.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0)


def _covariance(a: np.ndarray, b: np.ndarray) -> float:
    """The covariance of the two means (0 for fewer than 10 values)."""
    n = len(a)
    return float(((a * b).sum() / n - (a.sum() / n) * (b.sum() / n)) / (n - 1)) if n >= 10 else 0.0


class KldStats:
    """Per scored token: the nll of the run and of the base, KL(base || run), whether the top
    tokens agree. Prints llama-perplexity's per-chunk rows and summary."""

    CHUNK_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                    "              Δp RMS            Same top p")

    def __init__(self) -> None:
        self._cols: list[list] = [[], [], [], []]

    def add(self, nll: float, nll_base: float, kld: float, same_top: bool) -> None:
        for col, v in zip(self._cols, (nll, nll_base, kld, same_top)):
            col.append(v)

    def _arrays(self):
        nll, nll_base, kld, same = (np.array(c, dtype=np.float64) for c in self._cols)
        return nll, nll_base, kld, np.exp(-nll) - np.exp(-nll_base), same

    @staticmethod
    def _log_ratio(nll: np.ndarray, nll_base: np.ndarray) -> tuple[float, float]:
        """ln(PPL(Q)/PPL(base)) and its uncertainty; rounding can make the variance of a
        difference of identical runs slightly negative, hence the clamp."""
        lq, uq = _mean_unc(nll)
        lb, ub = _mean_unc(nll_base)
        var = uq * uq + ub * ub - 2.0 * _covariance(nll, nll_base)
        return lq - lb, np.sqrt(var) if var > 0 else 0.0

    @staticmethod
    def _rms(p_diff: np.ndarray) -> tuple[float, float]:
        mse, mse_unc = _mean_unc(p_diff * p_diff)
        rms = np.sqrt(mse)
        return rms, (0.5 / rms * mse_unc if rms > 0 else 0.0)

    @staticmethod
    def _same_top(same: np.ndarray) -> tuple[float, float]:
        f = float(same.mean())
        return f, (np.sqrt(f * (1.0 - f) / (len(same) - 1)) if len(same) > 1 else 0.0)

    def chunk_line(self, chunk: int) -> str:
        """The row printed after chunk (0-based): running values over every token so far."""
        nll, nll_base, kld, p_diff, same = self._arrays()
        lq, uq = _mean_unc(nll)
        ratio, ratio_unc = self._log_ratio(nll, nll_base)
        k, k_unc = _mean_unc(kld)
        rms, rms_unc = self._rms(p_diff)
        top, top_unc = self._same_top(same)
        ppl = np.exp(lq)
        return (f"{chunk + 1:4d}    {ppl:9.4f} ± {ppl * uq:9.4f}    {ratio:10.5f} ± {ratio_unc:10.5f}"
                f"    {k:10.5f} ± {k_unc:10.5f}    {100 * rms:6.3f} ± {100 * rms_unc:6.3f} %"
                f"    {100 * top:6.3f} ± {100 * top_unc:6.3f} %")

    def summary(self) -> str:
        """The three blocks printed after the last chunk."""
        nll, nll_base, kld, p_diff, same = self._arrays()
        lq, uq = _mean_unc(nll)
        lb, ub = _mean_unc(nll_base)
        cov = _covariance(nll, nll_base)
        ratio, ratio_unc = self._log_ratio(nll, nll_base)
        ppl, ppl_base = np.exp(lq), np.exp(lb)
        diff_var = (ppl * uq) ** 2 + (ppl_base * ub) ** 2 - 2.0 * ppl * ppl_base * cov
        diff_unc = np.sqrt(diff_var) if diff_var > 0 else 0.0
        cor = 100.0 * cov / (uq * ub) if uq * ub > 0 else 0.0
        out = [
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {ppl:10.6f} ± {ppl * uq:10.6f}",
            f"Mean PPL(base)                : {ppl_base:10.6f} ± {ppl_base * ub:10.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {cor:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6f} ± {ratio_unc:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {np.exp(ratio):10.6f} ± {np.exp(ratio) * ratio_unc:10.6f}",
            f"Mean PPL(Q)-PPL(base)         : {ppl - ppl_base:10.6f} ± {diff_unc:10.6f}",
            "",
        ]
        k, k_unc = _mean_unc(kld)
        out += ["====== KL divergence statistics ======", f"Mean    KLD: {k:10.6f} ± {k_unc:10.6f}"]
        for label, q in (("Maximum", 1.0), ("99.9%  ", 0.999), ("99.0%  ", 0.990), ("95.0%  ", 0.950),
                         ("90.0%  ", 0.900), ("Median ", 0.5), ("10.0%  ", 0.100), (" 5.0%  ", 0.050),
                         (" 1.0%  ", 0.010), (" 0.1%  ", 0.001), ("Minimum", 0.0)):
            out.append(f"{label} KLD: {np.quantile(kld, q):10.6f}")
        out.append("")
        dp, dp_unc = _mean_unc(p_diff)
        rms, rms_unc = self._rms(p_diff)
        top, top_unc = self._same_top(same)
        out += ["====== Token probability statistics ======", f"Mean    Δp: {100 * dp:6.3f} ± {100 * dp_unc:5.3f} %"]
        for label, q in (("Maximum", 1.0), ("99.9%  ", 0.999), ("99.0%  ", 0.990), ("95.0%  ", 0.950),
                         ("90.0%  ", 0.900), ("75.0%  ", 0.750), ("Median ", 0.5), ("25.0%  ", 0.250),
                         ("10.0%  ", 0.100), (" 5.0%  ", 0.050), (" 1.0%  ", 0.010), (" 0.1%  ", 0.001),
                         ("Minimum", 0.0)):
            out.append(f"{label} Δp: {100 * np.quantile(p_diff, q):6.3f}%")
        out += [f"RMS Δp    : {100 * rms:6.3f} ± {100 * rms_unc:5.3f} %",
                f"Same top p: {100 * top:6.3f} ± {100 * top_unc:5.3f} %"]
        return "\n".join(out)
