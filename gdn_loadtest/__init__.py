"""gdn-loadtest: N concurrent clients decoding against a gdn-serve server, next to a gRPC floor.

A tool beside the client library: it talks to the server through gdn_client's public API and
its generated stubs. Each client (an asyncio task with its own channel and TCP connection) owns
``--batch`` sessions and walks them through the model as a decoder would (gdn_loadtest.workers).
Inputs are random, drawn and encoded once per client before timing (a few sets, rotated);
requests always carry positions.

    gdn-loadtest --target 127.0.0.1:50051 --clients 1,8,64 --mode stream --duration 10 \\
        --echo --json results.json --plot plots/

prints one row per clients value: steps/s, tokens*layers/s (= steps/s * B * T), p50/p90/p99
latency, errors, the server's mean rows per kernel launch over the run (GetStats delta), and with
``--echo`` the same load against a bytes echo server with identical message sizes
(gdn_loadtest.echo, started as a subprocess), our throughput as a percentage of it on our row.
Each echo run follows the run of ours it is compared with. ``--rounds K`` repeats each pair K
times, alternating, and adds a line per clients value with the median of the K percentages: a
host's echo rate moves by 10-20% from one run to the next, and so does a single percentage.
``--processes P`` spreads each run's clients over P load processes started together
(gdn_loadtest.processes). The JSON records, per run, how busy the load's host was (busy cores,
and steal: time a VM's hypervisor gave to others) and the cores the load's own processes used
(``load_cores``): with the server on the same host, a run near all cores busy or with much steal
measures the host.

``--verify`` checks every output number against the decode math done on the client
(gdn_loadtest.verify); a wrong output fails the run.

Modules: cli (the command line), run (one run), drive (the measured loop), workers (the
clients), processes (several load processes), echo (the floor), verify, report, progress.
"""
