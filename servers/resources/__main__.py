"""Run a resources server: `python -m servers.resources --environment counter --name resources/counter`."""

from __future__ import annotations

import argparse

from gymrpc.v1 import resources_service_pb2 as pb
from gymrpc.v1 import resources_service_pb2_grpc as pb_grpc
from servers.bootstrap import ServiceBinding, add_common_arguments, config_from_arguments, run, serve
from servers.resources.plugins import load_environment
from servers.resources.service import ResourcesServicer


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m servers.resources", description=__doc__)
    add_common_arguments(parser, default_name="resources/counter")
    parser.add_argument("--environment", default="counter", help="counter, blackjack, or module:Class")
    parser.add_argument("--workers", type=int, default=8, help="threads running environment code")
    args = parser.parse_args()
    config = config_from_arguments(args)
    environment = load_environment(args.environment)()

    async def main_async() -> None:
        servicer = ResourcesServicer(environment, workers=args.workers)
        binding = ServiceBinding(
            pb.DESCRIPTOR.services_by_name["ResourcesService"],
            servicer,
            pb_grpc.add_ResourcesServiceServicer_to_server,
        )

        async def stop() -> None:
            servicer.host.shutdown()

        await serve(config, [binding], on_stop=stop)

    run(f"resources:{args.environment}", main_async, args.log_level)


if __name__ == "__main__":
    main()
