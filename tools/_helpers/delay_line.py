"""A delay line for TCP, for kernels without ``sch_netem``: a proxy that forwards each
direction's bytes ``delay`` after they arrive, as a long link's propagation delay does.

Each chunk read is stamped on arrival and written once its time has come, so a connection's bytes
stay pipelined: the delay adds to each request's round trip, not to each chunk (a proxy that
slept per chunk would cap a connection at chunk / delay). Run in a process of its own, so that
its event loop does not share the measured process's GIL (tools/remote_bench.py).

    python tools/_helpers/delay_line.py LISTEN_PORT TARGET_HOST TARGET_PORT ONE_WAY_MS
"""

from __future__ import annotations

import asyncio
import sys

CHUNK = 1 << 16


async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay`` seconds after it was read."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

    async def send() -> None:
        try:
            while (item := await queue.get()) is not None:
                due, chunk = item
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    sender = asyncio.create_task(send())
    try:
        while chunk := await reader.read(CHUNK):
            queue.put_nowait((loop.time() + delay, chunk))
    except ConnectionError:
        pass
    finally:
        queue.put_nowait(None)
        await sender


async def serve(listen_port: int, host: str, port: int, delay: float) -> None:
    async def connection(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(host, port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(forward(client_r, server_w, delay), forward(server_r, client_w, delay))

    server = await asyncio.start_server(connection, "127.0.0.1", listen_port)
    print("ready", flush=True)  # the bench waits for this line
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    listen, host, port, one_way_ms = sys.argv[1:5]
    asyncio.run(serve(int(listen), host, int(port), float(one_way_ms) / 1000))
