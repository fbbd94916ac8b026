"""The ``vlkv`` command line (``main.py``): one module per product command, the flags they share defined once
(``flags.py``, ``verify_flags.py``), and the lab's commands when the lab is installed (``lab.py``)."""
