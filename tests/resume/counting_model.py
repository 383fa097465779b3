"""The real model server (`python -m gymrpc.servers.model`) that also appends each Generate's request id to a file.

Test-only: proves which episodes made model calls (a cached episode must make none). The file
is `$GYMRPC_TEST_MODEL_LOG`; one line per Generate the server received, retries included.
"""

from __future__ import annotations

import os
from typing import Any

from gymrpc.servers.model import __main__ as model_main
from gymrpc.servers.model.service import ModelServicer


def main() -> None:
    path = os.environ["GYMRPC_TEST_MODEL_LOG"]
    generate = ModelServicer.Generate

    async def counted(self: ModelServicer, request: Any, context: Any) -> Any:
        with open(path, "a") as log:  # noqa: ASYNC230 - a local append, microseconds
            log.write(request.request_id + "\n")
        return await generate(self, request, context)

    ModelServicer.Generate = counted  # type: ignore[method-assign]
    model_main.main()


if __name__ == "__main__":
    main()
