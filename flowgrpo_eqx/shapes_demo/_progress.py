"""Progress bars (tqdm, loaded when a bar is made) that show the latest metrics."""

import sys
from typing import Any, final


@final
class Progress:
    """A progress bar over `total` units with metric read-outs.

    **Arguments:**

    - `total`: the number of units (steps, epochs).
    - `description`: the bar's label.
    - `disable`: quiet mode: draw nothing.
    - `initial`: units already done (when resuming).
    """

    def __init__(self, total: int, description: str, *, disable: bool = False, initial: int = 0):
        from tqdm.auto import tqdm

        self.bar = tqdm(
            total=total,
            desc=description,
            initial=initial,
            disable=disable,
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5,
        )

    def update(self, count: int = 1, **metrics: Any) -> None:
        shown = {k: f"{v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float))}
        if shown:
            self.bar.set_postfix(shown, refresh=False)
        self.bar.update(count)

    def close(self) -> None:
        self.bar.close()
