"""Looking at an optimizer without running it: which rule each leaf gets and its state
(``describe``), and state sizes measured and by the paper's formulas (``memory``)."""
