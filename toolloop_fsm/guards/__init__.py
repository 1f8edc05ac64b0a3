"""Guards: the pure decisions of the machines, one module per family.

Each guard is a pure function of the machine's state (which carries its policy). The order
in which guards are tried lives in the declarations (`machine.py`, `generation.py`).
"""
