"""Statistics for the tests that check a distribution is kept (sampled verification, cloud offload)."""

import torch


def chi2_p_value(observed: list[int], expected_probs: list[float]) -> float:
    """Pearson χ² goodness of fit; rare categories pooled so every expected count is >= 5."""
    total = sum(observed)
    pairs = sorted(zip(expected_probs, observed), reverse=True)
    cells, acc_e, acc_o = [], 0.0, 0
    for p, o in pairs:
        acc_e += p * total
        acc_o += o
        if acc_e >= 5:
            cells.append((acc_e, acc_o))
            acc_e, acc_o = 0.0, 0
    if acc_e > 0 or acc_o > 0:
        if cells:
            e, o = cells.pop()
            cells.append((e + acc_e, o + acc_o))
        else:
            cells.append((acc_e, acc_o))
    stat = sum((o - e) ** 2 / e for e, o in cells)
    dof = max(1, len(cells) - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
