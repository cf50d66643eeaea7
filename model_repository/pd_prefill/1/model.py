"""Thin Triton entry point: the role lives in backends/pd_prefill/ (the stub does not honour PYTHONPATH, so the
project root comes from the model config's parameters)."""

import faulthandler
import json
import os
import signal
import sys


class TritonPythonModel:
    def initialize(self, args):
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <stub pid>` dumps every stack
        root = json.loads(args["model_config"])["parameters"]["project_root"]["string_value"]
        if not os.path.isabs(root):  # relative to this model's folder: a repository with its own copy of the code
            root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", root))
        if root not in sys.path:
            sys.path.insert(0, root)
        from backends.pd_prefill.model import PrefillModel

        self.impl = PrefillModel(args)

    def execute(self, requests):
        return self.impl.execute(requests)

    def finalize(self):
        self.impl.finalize()
