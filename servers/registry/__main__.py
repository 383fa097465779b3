"""Run the registry: `python -m gymrpc.servers.registry --bind unix:/run/dir/registry.sock`."""

from __future__ import annotations

import argparse

from gymrpc.servers.bootstrap import ServiceBinding, add_common_arguments, config_from_arguments, run, serve
from gymrpc.servers.registry.service import CONTROL_METHODS, RegistryServicer
from gymrpc.v1 import registry_service_pb2 as pb
from gymrpc.v1 import registry_service_pb2_grpc as pb_grpc


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gymrpc.servers.registry", description=__doc__)
    add_common_arguments(parser, default_name="registry/main")
    args = parser.parse_args()
    config = config_from_arguments(args)
    servicer = RegistryServicer()

    async def main_async() -> None:
        servicer.start()
        binding = ServiceBinding(
            pb.DESCRIPTOR.services_by_name["RegistryService"],
            servicer,
            pb_grpc.add_RegistryServiceServicer_to_server,
            CONTROL_METHODS,
        )
        await serve(config, [binding], on_stop=servicer.stop)

    run("registry", main_async, args)


if __name__ == "__main__":
    main()
