"""Smoke run of the real-SGLang harness for one version.

    python tests/sglang_real/smoke.py 0.5.13 [--json OUT.json]

Prepares the overlay (tools/sglang_real_env.sh VERSION, cached), then runs
itself in a child process with the overlay first on PYTHONPATH (one sglang
version per process). For bf16 and fp32, for T in (0, 1, 5) and for extend
and decode batches (T = 0 is an IDLE batch), it runs SGLang's own
DeepseekV2ForCausalLM.forward and checks:

* hook:  every aux slot k equals, bit for bit, ``hidden_states + residual``
         at the input of layer ``layers_to_capture[k]`` (read by a forward
         pre-hook on the decoder layer, before the layer runs; in 0.5.23,
         where the residual is no layer argument, through
         ``layer_boundary.residual.batch.snapshot(hidden, forward_batch)``);
* ref:   an independent pure-torch re-computation of the residual stream
         (embedding, the stand-ins, RMSNorm in fp32 math with the model's own
         norm weights) matches the aux slots and the final hidden states
         (fp32: 1e-5, bf16: 2e-2 relative to max |x|);
* shape: final (T, H), aux: T rows each.

Prints the version, the surface, the shapes and one line per case; exits
non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def parent(version: str, json_out: str | None) -> int:
    env_sh = os.path.join(ROOT, "tools", "sglang_real_env.sh")
    overlay = (
        subprocess.run(
            ["bash", env_sh, version],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PY=sys.executable),
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [overlay, ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.setdefault("PYTHONWARNINGS", "ignore")
    cmd = [sys.executable, os.path.abspath(__file__), version, "--child"]
    if json_out:
        cmd += ["--json", json_out]
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


def _reference(model, input_ids, capture):
    """Pure-torch residual stream with the model's own weights and stand-ins."""
    import torch

    def rms(x, norm):
        xf = x.float()
        var = xf.pow(2).mean(-1, keepdim=True)
        y = xf * torch.rsqrt(var + norm.variance_epsilon)
        return (y * norm.weight.float()).to(x.dtype)

    m = model.model
    h = m.embed_tokens.weight[input_ids]
    residual = None
    aux = []
    for i, layer in enumerate(m.layers):
        if i in capture:
            aux.append(h + residual if residual is not None else h)
        if residual is None:
            residual = h
        else:
            residual = (h.float() + residual.float()).to(h.dtype)
        x = rms(residual, layer.input_layernorm)
        a = layer.self_attn(hidden_states=x)
        residual = (a.float() + residual.float()).to(a.dtype)
        x = rms(residual, layer.post_attention_layernorm)
        h = layer.mlp(x)
    final = rms((h.float() + residual.float()).to(h.dtype), m.norm)
    return final, aux


def child(version: str, json_out: str | None) -> int:
    import inspect

    import torch

    sys.path.insert(0, ROOT)
    from tests.sglang_real import harness

    harness.setup(version)
    results = {"version": harness.sglang_version(), "cases": []}
    ok_all = True
    print(f"sglang {results['version']}  torch {torch.__version__}")
    for dtype in (torch.bfloat16, torch.float32):
        model = harness.build(num_layers=6, hidden=64, dtype=dtype, capture_ids=(1, 2, 4), seed=1)
        if dtype is torch.bfloat16:
            print("surface:", json.dumps(harness.SURFACE, default=str))
            results["surface"] = dict(harness.SURFACE)
        capture = list(model.model.layers_to_capture)

        seen = {}

        def make_hook(i):
            sig = inspect.signature(type(model.model.layers[i]).forward)

            if "residual" in sig.parameters:  # <= 0.5.22: (hidden, residual) args

                def hook(mod, args, kwargs):
                    b = sig.bind(mod, *args, **kwargs)
                    hs, res = b.arguments["hidden_states"], b.arguments["residual"]
                    seen[i] = (hs + res) if res is not None else hs.clone()
            else:  # 0.5.23: the residual lives in forward_batch.residual_stream
                from sglang.srt.layers.layer_boundary.residual import batch as rb

                def hook(mod, args, kwargs):
                    b = sig.bind(mod, *args, **kwargs)
                    # ResidualStream.snapshot: pending output + written
                    # residual (a clone when nothing is written yet); no
                    # side effects on the stream.
                    seen[i] = rb.snapshot(
                        b.arguments["hidden_states"], b.arguments["forward_batch"]
                    )

            return hook

        handles = [
            layer.register_forward_pre_hook(make_hook(i), with_kwargs=True)
            for i, layer in enumerate(model.model.layers)
        ]
        tol = 1e-5 if dtype is torch.float32 else 2e-2
        for T, mode in [(0, "idle"), (1, "extend"), (5, "extend"), (1, "decode"), (5, "decode")]:
            case = {"dtype": str(dtype).replace("torch.", ""), "T": T, "mode": mode}
            seen.clear()
            try:
                batch = harness.make_batch(model, T, "extend" if mode == "idle" else mode, seed=T)
                call = harness.run(model, batch)
                hs, aux = call.hidden_states, call.aux_hidden_states
            except Exception as e:  # report, keep going
                case.update(ok=False, error=f"{type(e).__name__}: {e}")
                ok_all = False
                print(json.dumps(case))
                results["cases"].append(case)
                continue
            # <= 0.5.13: a list of K [T, H] tensors; >= 0.5.18 (where the model
            # uses AuxHiddenStatePacker): one packed [T, K * H] tensor.
            if isinstance(aux, (list, tuple)):
                aux_list = list(aux)
            elif isinstance(aux, torch.Tensor) and aux.shape[-1] == 64 * len(capture):
                aux_list = list(aux.split(64, dim=-1))
                case["aux_packed_shape"] = list(aux.shape)
            else:
                aux_list = None
            case["final_shape"] = list(hs.shape)
            case["aux_type"] = type(aux).__name__
            case["aux_shapes"] = [list(a.shape) for a in aux_list] if aux_list else None
            checks = {}
            checks["shape"] = (
                tuple(hs.shape) == (T, 64)
                and aux_list is not None
                and len(aux_list) == len(capture)
                and all(a.shape == (T, 64) for a in aux_list)
            )
            checks["hook_exact"] = (
                aux_list is not None
                and len(aux_list) == len(capture)
                and all(i in seen and torch.equal(a, seen[i]) for a, i in zip(aux_list, capture))
            )
            # What the draft receives, from SGLang's own LogitsProcessor (FULL
            # mode): the captures side by side, every row.
            drafted = harness.draft_input(call)
            checks["draft_input"] = (
                aux_list is not None
                and drafted is not None
                and torch.equal(drafted, torch.cat(aux_list, dim=-1))
            )
            ref_final, ref_aux = _reference(model, batch[0], capture)

            def close(a, b):
                if a.numel() == 0 and b.numel() == 0:
                    return a.shape == b.shape
                scale = max(float(b.float().abs().max()), 1.0)
                return float((a.float() - b.float()).abs().max()) <= tol * scale

            checks["ref_aux"] = aux_list is not None and all(
                close(a, r) for a, r in zip(aux_list, ref_aux)
            )
            if T:
                # Negative control: the same comparison against the residual
                # one layer later must fail (the check can tell layers apart).
                _, shifted = _reference(model, batch[0], [c - 1 for c in capture])
                checks["discriminates"] = aux_list is not None and not any(
                    close(a, r) for a, r in zip(aux_list, shifted)
                )
            # IDLE: SGLang skips the final norm (empty tensor either way).
            checks["ref_final"] = close(hs, ref_final) if T else hs.shape[0] == 0
            checks["dtype"] = hs.dtype == dtype and all(a.dtype == dtype for a in aux_list or [])
            # Every SGLang RMSNorm that ran took the pure-torch path.
            from sglang.srt.layers.layernorm import RMSNorm

            methods = {
                getattr(m._forward_method, "__name__", None)
                for m in model.modules()
                if isinstance(m, RMSNorm) and m._forward_method is not None
            }
            case["norm_methods"] = sorted(map(str, methods))
            checks["norm_native"] = methods <= {"forward_native"}
            case["checks"] = checks
            case["ok"] = all(checks.values())
            ok_all &= case["ok"]
            print(json.dumps(case))
            results["cases"].append(case)
        for h in handles:
            h.remove()
    # Informational (not a pass/fail check): does this version allow capturing
    # the input of layer 0 (residual is still None there)?
    # set_eagle3_layers_to_capture([0, 2]) maps to layers_to_capture [1, 3]
    # in 0.5.9 (always +1) and to [0, 2] from 0.5.13 on (+1 only when
    # layer_ids[0] == 1).
    model.set_eagle3_layers_to_capture([0, 2])
    ltc = list(model.model.layers_to_capture)
    try:
        harness.run(model, harness.make_batch(model, 3, "extend"))
        results["capture_layer0"] = f"ids [0, 2] -> layers_to_capture {ltc}: ran"
    except Exception as e:
        results["capture_layer0"] = (
            f"ids [0, 2] -> layers_to_capture {ltc}: {type(e).__name__}: {e}"
        )
    print("info: capture of layer 0 ->", results["capture_layer0"])
    results["ok"] = ok_all
    print("RESULT", results["version"], "PASS" if ok_all else "FAIL")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0 if ok_all else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("version")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sys.exit(child(a.version, a.json) if a.child else parent(a.version, a.json))
