"""Run an older checkout of Voxgate with this venv (bench/bench_conversation.py --before-tree): on the
PYTHONPATH of a server process, this points the editable install's module map at VOXGATE_BEFORE_TREE, a
`git worktree` of the code before a change, and puts its finder first (`python -m` would otherwise find the
current checkout's voxgate/ in the working directory), so both servers of one run differ only in the code."""

import os
import sys

_tree = os.environ.get("VOXGATE_BEFORE_TREE")
if _tree:
    for _name, _module in list(sys.modules.items()):
        _mapping = getattr(_module, "MAPPING", None)
        if _name.startswith("__editable___voxgate") and isinstance(_mapping, dict):
            for _key, _path in _mapping.items():
                _mapping[_key] = os.path.join(_tree, os.path.basename(_path))
            for _finder in list(sys.meta_path):
                if type(_finder).__module__ == _name or getattr(_finder, "__module__", None) == _name:
                    sys.meta_path.remove(_finder)
                    sys.meta_path.insert(0, _finder)
