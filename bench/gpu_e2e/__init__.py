"""End-to-end numbers on a GPU host: engine floor, gateway under load, native baseline, data parallelism.

One bounded script for a GPU host (1 or 2 H200s; also runs on CPU as a dry run of the code path).
Phases (``--phases``, in this order):

* ``floor``: ``bench.engine_bench`` (vLLM code engine alone, CUDA graphs on GPU) at
  ``--floor-concurrency``; optionally the upstream reference backend (``--floor-reference``).
* ``e2e``: the real gateway (``python -m voicegw.cli serve``, vLLM engine, data_parallel_size 1)
  on 127.0.0.1, driven by ``loadtest`` over loopback: the ``steady`` scenario (clients play audio
  in real time; text streamed like an LLM) for each of ``--sessions``; then the ``closed-loop``
  scenario at ``--compare-concurrency`` (the side-by-side with the native pipeline) and at
  ``--throughput-sessions`` (aggregate audio per wall second).
* ``burst``: the same gateway; ``--burst-background`` sessions play long answers and
  ``--burst-sessions`` newcomers arrive at once ``--burst-at`` s later: the newcomers' TTFA and
  underruns, and the playing streams' underruns from the burst on.
  (``e2e --with-burst``: the same level on the e2e gateway, after its steady levels.)
* ``native``: upstream ChatTTS ``Chat.infer(stream=True)`` one request at a time behind the same
  gateway (``loadtest.baseline.NativePipelineSpeech`` on ``--device``), closed loop at
  ``--native-concurrency``.
* ``dp``: the gateway with vLLM ``data_parallel_size=--dp`` (needs that many GPUs): ``steady`` at
  ``--dp-sessions`` and the throughput run; capacity ratio against the ``e2e`` phase.

Per level: TTFA p50/p99 (first PCM byte at the client minus first text sent), seg-TTFA (minus the
text that completed the first segment), per-stream real-time factor (audio seconds delivered per
wall second of each answer, between its first and last audio; the gateway's flow control keeps
a stream at most ``limits.flow_window_ms`` ahead, so a stream that keeps up shows >= 1), underruns,
errors, GPU memory (``nvidia-smi``, whole GPU, peak during the level), server RSS (process tree).
A level is *real time* when it has no underrun, no error and every session got audio.

Bounded: ``--max-minutes`` caps the whole call (levels that would not fit are skipped and listed),
``--phase-minutes floor=3,e2e=7`` caps phases. Results are written after every level: a JSON and a
Markdown file under ``--out`` (default ``$OUT``, else ``out/gpu``), merged with the state file
(``--state``, in /tmp) so several calls on one machine add up; ``--report-from A.json B.json``
merges result files without running anything.

    # GPU host, call 1 and call 2 (same machine; the checkpoint and state file in /tmp are reused)
    PYTHONPATH=/tmp/site python -m bench.gpu_e2e --phases floor,e2e --max-minutes 9.3
    PYTHONPATH=/tmp/site python -m bench.gpu_e2e --phases native,dp --dp 2 --max-minutes 9.3
    # CPU dry run of the code path (numbers meaningless)
    flock /tmp/voicegw-heavy.lock python -m bench.gpu_e2e --device cpu --size tiny --sessions 1,4 \\
        --phases floor,e2e --max-minutes 6 --out /tmp/gpu_e2e_test
"""
