"""The peer: a TorchServe handler written the way TorchServe's own examples write one.

JSON in (``{"instances": [{"dense": [13 floats], "sparse": [26 ids, -1 = missing]}, ...]}``),
``torch.tensor`` from the lists, the TorchScript forward, ``.tolist()`` out. ``BaseHandler``
loads the archive's serialized file with ``torch.jit.load``; nothing here knows this project.
The benchmark archives it with the same TorchScript artifact as the stack's .mar.
"""

import logging

import fbgemm_gpu  # noqa: F401  registers the fbgemm ops the artifact calls
import torch
from ts.torch_handler.base_handler import BaseHandler

logger = logging.getLogger(__name__)


class PlainHandler(BaseHandler):
    def initialize(self, context):
        super().initialize(context)
        logger.info("plain handler: %d threads", torch.get_num_threads())

    def preprocess(self, data):
        sizes, dense, sparse = [], [], []
        for row in data:
            body = row.get("data") or row.get("body")
            sizes.append(len(body["instances"]))
            dense += [x["dense"] for x in body["instances"]]
            sparse += [x["sparse"] for x in body["instances"]]
        ids = torch.tensor(sparse, dtype=torch.int64).T  # [26, B]
        present = ids >= 0
        return sizes, (torch.tensor(dense), ids[present], present.to(torch.int32))

    def inference(self, data, *args, **kwargs):
        sizes, inputs = data
        with torch.inference_mode():
            return sizes, self.model(*inputs)

    def postprocess(self, data):
        sizes, probs = data
        return [p.tolist() for p in torch.split(probs, sizes)]
