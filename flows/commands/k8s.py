"""`grpo k8s render`: the Kubernetes Job of each stage's flow run (or of a deployment's), as YAML, offline."""

from __future__ import annotations

from grpo.record.layout import STAGES
from stages import StageError


def cmd_k8s_render(args, storage):
    from flows import kubernetes as k8s

    if args.deployment:
        found = k8s.deployments(args.prefect_file)
        if args.deployment not in found:
            raise StageError(f"--deployment {args.deployment}: {args.prefect_file} has {', '.join(sorted(found))}")
        d = found[args.deployment]
        job = k8s.render_job(d, k8s.job_template(args.prefect_file), {"run_id": args.run}, args.run)
        what = f"deployment {args.deployment}: a flow run on pool {d['work_pool']['name']}"
        print(k8s.as_yaml([(what, job)]), end="")
        return
    jobs = k8s.stage_jobs(args.stage or STAGES, args.run, args.iteration, args.prefect_file)
    shown = [(f"stage {s}: a flow run of deployment {name}", job) for s, (name, job) in jobs.items()]
    print(k8s.as_yaml(shown), end="")
