"""The worker's services against in-memory hosts (tests/worker/fake_host.py): every transition, retry and
deadline of server/lifecycle.py as the worker drives it, with a clock that moves only when told."""

import time
from datetime import timedelta

from sqlalchemy import select

from server.lifecycle import NodeState, nodes_of
from server.models import Host, MetricPoint, Run
from tests.worker.conftest import GPU_WAIT_DEADLINE, UNREACHABLE_DEADLINE, Rig
from worker.host_errors import AuthRefused
from worker.run_driver import INGEST_READ_BYTES


def test_a_run_goes_from_queued_through_launching_to_running(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id)
    assert rig.run(run_id).status == "launching"
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "running" and run.message == "attempt 1 running"
    attempt = run.attempts[0]
    assert attempt.status == "running" and attempt.started_at == rig.clock.now()
    [node] = nodes_of(attempt)
    assert node.dir == "/ws/.longrun/run1/1" and node.state == NodeState.RUNNING
    job = rig.hosts["a"].job(run_id, 1)
    assert node.pid == job.pids[0] and job.token == attempt.token
    assert "--standalone" in job.argv and job.argv[-1] == "/ws/train.py"
    assert rig.statuses(run_id) == ["queued", "launching", "running"]


def test_a_finished_job_stores_its_metrics_and_log_and_the_run_succeeds(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    host = rig.hosts["a"]
    job = host.job(run_id, 1)
    host.write_metrics(job, {"step": 1, "total_steps": 2, "loss": 0.9}, {"step": 2, "total_steps": 2, "loss": 0.5})
    job.log = "training\n"
    rig.step(run_id)
    assert rig.run(run_id).latest["loss"] == 0.5 and rig.run(run_id).status == "running"
    host.finish(job, 0)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "succeeded" and run.lease_owner is None and run.ended_at == rig.clock.now()
    attempt = run.attempts[0]
    assert (attempt.status, attempt.exit_code) == ("succeeded", 0)
    assert nodes_of(attempt)[0].state == NodeState.EXITED
    with rig.db.reading() as s:
        assert [p.value for p in s.scalars(select(MetricPoint).where(MetricPoint.name == "loss"))] == [0.9, 0.5]
    assert run_id not in rig.supervisor.claimer.run_once(), "a terminal run is not driven"


def test_a_failed_attempt_is_retried_with_the_same_spec_then_the_run_fails(rig: Rig) -> None:
    run_id = rig.submit(max_retries=1)
    rig.step(run_id, 2)
    rig.hosts["a"].finish(rig.hosts["a"].job(run_id, 1), 3)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "launching" and run.attempt == 2 and run.retries_used == 1
    assert run.message == "retry 1 of 1: attempt 1 exited with code 3 on a; see its log"
    first, second = run.attempts
    assert (first.status, first.exit_code) == ("failed", 3) and second.spec == first.spec
    assert second.token != first.token
    rig.step(run_id)
    assert rig.run(run_id).status == "running"
    rig.hosts["a"].finish(rig.hosts["a"].job(run_id, 2), 4)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "failed" and run.message == "attempt 2 exited with code 4 on a; see its log"
    assert rig.statuses(run_id) == ["queued", "launching", "running", "launching", "running", "failed"]


def test_processes_that_vanish_without_an_exit_code_fail_the_attempt(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    rig.hosts["a"].vanish(rig.hosts["a"].job(run_id, 1))
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "failed" and "lost its wrapper on a: it died without recording" in run.message
    assert run.attempts[0].exit_code is None and nodes_of(run.attempts[0])[0].state == NodeState.LOST


def test_a_dead_wrappers_job_is_stopped_before_the_attempt_is_retried(rig: Rig) -> None:
    run_id = rig.submit(max_retries=1)
    rig.step(run_id, 2)
    host = rig.hosts["a"]
    job = host.job(run_id, 1)
    job.stubborn = True
    host.kill_wrapper(job)
    rig.step(run_id)
    run = rig.run(run_id)
    assert (run.status, run.attempt) == ("running", 1), "no retry while the lost wrapper's job still runs"
    job.stubborn = False
    rig.step(run_id)
    run = rig.run(run_id)
    assert not job.orphaned, "the host stopped the job the dead wrapper left"
    assert (run.status, run.attempt) == ("launching", 2)
    assert "attempt 1 lost its wrapper on a: it died without recording the job's exit code" in run.message


def test_one_node_failing_stops_the_other_nodes_then_fails_the_attempt(rig: Rig) -> None:
    run_id = rig.submit("a", "b")
    rig.step(run_id, 2)
    first, second = rig.hosts["a"].job(run_id, 1), rig.hosts["b"].job(run_id, 1, node=1)
    assert second.dir == "/ws/.longrun/run1/1/node1" and "--node-rank=1" in second.argv
    rig.hosts["b"].finish(second, 1)
    rig.step(run_id)
    assert not first.alive and first.exit_code == 137, "the healthy node was stopped"
    assert rig.run(run_id).status == "running", "decided on the next look, once every node has ended"
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "failed" and "exited with code 137 on a" in run.message


def test_cancel_stops_every_process_and_keeps_trying_while_some_survive(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    job = rig.hosts["a"].job(run_id, 1)
    job.stubborn = True
    rig.cancel(run_id)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "cancelling" and run.message == f"cancelling: processes {job.pids} still alive; trying again"
    job.stubborn = False
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "cancelled" and run.message == "cancelled; no process of the run remains"
    assert (run.attempts[0].status, run.attempts[0].message) == ("cancelled", "cancelled on request")


def test_restart_stops_the_old_attempt_then_launches_the_new_one_in_the_same_step(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    rig.restart(run_id, args=["--ttt-steps", "5"])
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "running" and run.attempt == 2
    old = rig.hosts["a"].job(run_id, 1)
    assert not old.alive and run.attempts[0].message == "superseded by attempt 2"
    assert rig.hosts["a"].job(run_id, 2).argv[-2:] == ["--ttt-steps", "5"]
    assert rig.hosts["a"].verbs()[-2:] == ["cancel", "launch"]
    assert rig.statuses(run_id)[-3:] == ["restarting", "launching", "running"]


def test_a_clean_restart_empties_the_output_keeping_the_draft_it_starts_from(rig: Rig) -> None:
    run_id = rig.submit(output_dir="/ws/out")
    rig.step(run_id, 2)
    host = rig.hosts["a"]
    host.files |= {"/ws/out/model.safetensors", "/ws/out/log.txt"}
    stash = "/ws/.longrun/run1/draft-before-attempt-2"
    rig.restart(run_id, clean=True, trainer={"verifier_path": "/ws/v", "data_dir": "/ws/d", "vocab_mapping_dir": "/ws/m",
                                            "output_dir": "/ws/out", "init_from": stash})
    rig.step(run_id)
    clean = next(req for verb, req in host.calls if verb == "clean")
    # with the workspace's real path as resolved at registration, for the host to check it still leads there
    assert clean == {"workspace": "/ws", "records": "/ws/.longrun", "path": "/ws/out", "keep_into": stash,
                     "workspace_check": {"path": "/ws", "real": "/ws"}}
    assert host.files == {f"{stash}/model.safetensors"}
    assert rig.run(run_id).status == "running" and rig.run(run_id).clean_pending is False


def test_a_run_submitted_to_start_fresh_has_its_output_emptied_before_its_first_launch(rig: Rig) -> None:
    trainer = {"verifier_path": "/ws/v", "data_dir": "/ws/d", "vocab_mapping_dir": "/ws/m", "output_dir": "/ws/out"}
    run_id = rig.submit(entrypoint=None, trainer=trainer)
    with rig.db.writing() as s:
        s.get(Run, run_id).clean_pending = True  # as POST /v1/runs?start=fresh sets it
    host = rig.hosts["a"]
    host.files |= {"/ws/out/checkpoints/step_456/state.pt", "/ws/out/model.safetensors"}
    rig.step(run_id, 2)
    assert host.verbs().index("clean") < host.verbs().index("launch"), host.verbs()
    assert not any(f.startswith("/ws/out/") for f in host.files), "another run's checkpoint is gone before launch"
    assert rig.run(run_id).status == "running" and rig.run(run_id).clean_pending is False


def test_a_refused_clean_fails_the_run_with_the_hosts_words(rig: Rig) -> None:
    run_id = rig.submit(output_dir="/ws/.longrun/x")
    rig.step(run_id, 2)
    rig.restart(run_id, clean=True)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "failed" and run.message.startswith("refusing to clean /ws/.longrun/x")
    assert run.attempts[1].status == "failed"


def test_a_host_that_stops_answering_keeps_the_run_until_it_answers_again(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    rig.hosts["a"].go_down()
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "running" and run.host_reachable is False
    assert run.message == "host not answering since 12:00:00 UTC: connection to a refused"
    with rig.db.reading() as s:
        assert s.scalar(select(Host.reachable).where(Host.name == "a")) is False
    rig.clock.advance(UNREACHABLE_DEADLINE - 1)
    rig.step(run_id)
    assert rig.run(run_id).status == "running", "not before the deadline"
    rig.hosts["a"].come_back()
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.host_reachable is True and run.unreachable_since is None
    assert run.message == f"host answering again after {UNREACHABLE_DEADLINE - 1:.0f}s away"
    with rig.db.reading() as s:
        assert s.scalar(select(Host.reachable).where(Host.name == "a")) is True


def test_past_the_unreachable_deadline_the_run_fails_and_the_reaper_stops_the_job_later(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    rig.hosts["a"].go_down()
    rig.step(run_id)
    rig.clock.advance(UNREACHABLE_DEADLINE + 1)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "failed"
    assert run.message == f"host unreachable for more than {UNREACHABLE_DEADLINE:.0f}s: connection to a refused"
    attempt = run.attempts[0]
    assert attempt.status == "failed" and attempt.abandoned
    assert nodes_of(attempt)[0].state == NodeState.ABANDONED
    reaper = rig.supervisor.reaper
    assert reaper.run_once() == [attempt.id]
    reaper.stop(attempt.id)
    assert rig.attempt(run_id, 1).abandoned, "still away: tried again later"
    rig.hosts["a"].come_back()
    reaper.stop(attempt.id)
    job = rig.hosts["a"].job(run_id, 1)
    assert not job.alive
    attempt = rig.attempt(run_id, 1)
    assert not attempt.abandoned and nodes_of(attempt)[0].state == NodeState.EXITED
    assert attempt.status == "failed", "how the attempt ended does not change"
    assert reaper.run_once() == []


def test_a_reaper_sweep_is_due_once_per_interval(rig: Rig) -> None:
    reaper = rig.supervisor.reaper
    assert reaper.due() and not reaper.due()
    rig.clock.advance(reaper.interval)
    assert reaper.due()


def test_a_run_waits_while_others_hold_its_gpus_then_gets_the_free_ones(rig: Rig) -> None:
    host = rig.hosts["a"]
    stranger = host.hold_gpu(0)
    run_id = rig.submit(nproc_per_node=2)
    rig.step(run_id, 2)
    run = rig.run(run_id)
    assert run.status == "launching"
    assert run.message == (f"waiting for GPUs (0s of {GPU_WAIT_DEADLINE:.0f}s): on a: GPU 0 is held by pid "
                           f"{stranger.pid} (python3, user alice, 20000 MiB)")
    host.holders.clear()
    rig.clock.advance(10)
    rig.step(run_id)
    assert rig.run(run_id).status == "running"


def test_a_run_needing_one_gpu_is_placed_on_a_free_one(rig: Rig) -> None:
    rig.hosts["a"].hold_gpu(0)
    run_id = rig.submit(nproc_per_node=1)
    rig.step(run_id, 2)
    assert rig.hosts["a"].job(run_id, 1).env["CUDA_VISIBLE_DEVICES"] == "1"
    assert nodes_of(rig.attempt(run_id, 1))[0].gpus == [1]


def test_past_the_gpu_wait_deadline_the_run_fails(rig: Rig) -> None:
    rig.hosts["a"].hold_gpu(1)
    run_id = rig.submit()
    rig.step(run_id, 2)
    rig.clock.advance(GPU_WAIT_DEADLINE + 1)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "failed" and run.message.startswith(f"gave up after {GPU_WAIT_DEADLINE + 1:.0f}s waiting")
    assert run.attempts[0].status == "failed" and rig.hosts["a"].jobs == {}, "nothing was started"


def test_a_host_answer_of_another_shape_fails_the_run_with_a_message_and_escapes_no_service(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    rig.hosts["a"].garble = '{"state": "running", "exit_code": null, "pid": "1; rm -rf /", "metrics": ""}\n'
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "failed"
    assert run.message.startswith("probe: the host's answer is not of the expected shape (TypeError: pid is str")
    # the failed run leaves no job behind: the reaper stops it
    attempt = run.attempts[0]
    assert attempt.abandoned and rig.supervisor.reaper.run_once() == [attempt.id]
    rig.hosts["a"].garble = None
    rig.supervisor.reaper.stop(attempt.id)
    assert not rig.hosts["a"].job(run_id, 1).alive and not rig.attempt(run_id, 1).abandoned


def test_an_unreadable_host_answer_is_asked_again_and_the_run_keeps_running(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    host = rig.hosts["a"]
    host.write_metrics(host.job(run_id, 1), {"step": 1, "loss": 0.9})
    for lost in ("NOT JSON\n", "", '{"state": "running", "exit_co'):  # a stray line; an agent killed mid-answer
        host.garble, host.garble_left = lost, 1
        rig.step(run_id)
        run = rig.run(run_id)
        assert (run.status, run.host_reachable, run.message) == ("running", True, "attempt 1 running"), lost
    assert run.latest["loss"] == 0.9 and host.job(run_id, 1).alive


def test_an_agent_that_keeps_answering_garbage_is_a_host_away_then_the_run_fails_and_its_job_is_stopped(
        rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    host = rig.hosts["a"]
    host.garble = "NOT JSON\n"
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "running" and run.host_reachable is False
    assert run.message.startswith("host not answering since 12:00:00 UTC: probe: no readable answer from the host "
                                  "agent (exit 0): 'NOT JSON' (3 tries in a row)"), run.message
    rig.clock.advance(UNREACHABLE_DEADLINE + 1)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "failed" and run.message.startswith(
        f"host unreachable for more than {UNREACHABLE_DEADLINE:.0f}s: probe: no readable answer"), run.message
    attempt = run.attempts[0]
    assert attempt.abandoned and host.job(run_id, 1).alive
    rig.supervisor.reaper.stop(attempt.id)
    assert rig.attempt(run_id, 1).abandoned, "no readable answer yet: tried again later"
    host.garble = None
    rig.supervisor.reaper.stop(attempt.id)
    assert not host.job(run_id, 1).alive and not rig.attempt(run_id, 1).abandoned


def test_a_refused_key_fails_the_run_at_once(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id)
    rig.hosts["a"].refuse = AuthRefused("me@a refused the SSH key: add it to authorized_keys")
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "failed" and run.message == "me@a refused the SSH key: add it to authorized_keys"
    assert run.attempts[0].status == "failed"


def test_a_cancel_during_launch_wins_and_the_launched_job_is_stopped(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id)
    host = rig.hosts["a"]
    launch = host._launch

    def launch_then_cancel(req: dict) -> dict:
        answer = launch(req)
        rig.cancel(run_id)  # the API, between the launch and the worker's write
        return answer

    host._launch = launch_then_cancel
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "cancelling", "the worker's launch did not overwrite the cancel"
    assert nodes_of(run.attempts[0])[0].pid == host.job(run_id, 1).pids[0], "what it started is recorded"
    rig.step(run_id)
    assert rig.run(run_id).status == "cancelled" and not host.job(run_id, 1).alive


def test_gpus_are_sampled_as_run_metrics_once_per_interval(rig: Rig) -> None:
    run_id = rig.submit(nproc_per_node=1)
    rig.step(run_id, 3)
    assert {"gpu_util_0", "gpu_mem_0"} <= set(rig.run(run_id).latest)
    sampled = [req for verb, req in rig.hosts["a"].calls if verb == "probe" and req.get("gpus")]
    rig.step(run_id)
    assert len([req for verb, req in rig.hosts["a"].calls if verb == "probe" and req.get("gpus")]) == len(sampled)
    rig.clock.advance(5)
    rig.step(run_id)
    assert len([req for verb, req in rig.hosts["a"].calls if verb == "probe" and req.get("gpus")]) == len(sampled) + 1


def test_a_lease_held_by_a_live_worker_is_left_alone_until_it_expires(rig: Rig) -> None:
    run_id = rig.submit()
    with rig.db.writing() as s:
        run = s.get(Run, run_id)
        run.lease_owner, run.lease_until = "w2", rig.clock.now() + timedelta(seconds=5)
    assert rig.supervisor.claimer.run_once() == []
    rig.clock.advance(6)
    assert rig.supervisor.claimer.run_once() == [run_id]
    assert rig.run(run_id).lease_owner == "w1"


def test_the_gpu_snapshot_responder_answers_a_wanted_snapshot(rig: Rig) -> None:
    with rig.db.writing() as s:
        for host in s.scalars(select(Host)):
            host.gpu_wanted_at = rig.clock.now()
    rig.hosts["b"].go_down()
    responder = rig.supervisor.responder
    for host in responder.run_once():
        responder.answer(host)
    with rig.db.reading() as s:
        a, b = s.scalars(select(Host).order_by(Host.name))
    assert a.gpu_wanted_at is None and len(a.gpu_snapshot["gpus"]) == 2 and a.reachable
    assert b.gpu_wanted_at is None and b.reachable is False and "refused" in b.last_error
    assert responder.run_once() == []


def test_a_supervisor_tick_hands_each_services_work_to_the_pool_and_a_launch_follows_at_once(rig: Rig) -> None:
    run_id = rig.submit()
    with rig.db.writing() as s:
        s.scalar(select(Host).where(Host.name == "b")).gpu_wanted_at = rig.clock.now()
    rig.supervisor.tick()
    deadline = time.monotonic() + 10
    while rig.run(run_id).status != "running":
        assert time.monotonic() < deadline, "queued -> launching -> running took more than one tick"
        time.sleep(0.01)
    rig.supervisor.close()  # waits for the work in hand
    assert rig.statuses(run_id) == ["queued", "launching", "running"] and rig.run(run_id).lease_owner == "w1"
    with rig.db.reading() as s:
        assert s.scalar(select(Host).where(Host.name == "b")).gpu_snapshot is not None


def test_a_queued_run_cancelled_before_launch_is_cancelled_without_touching_a_host(rig: Rig) -> None:
    run_id = rig.submit()
    rig.cancel(run_id)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "cancelled" and run.attempts[0].status == "cancelled"
    assert rig.hosts["a"].calls == []


def test_a_restart_waits_while_the_old_attempts_processes_survive(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    old = rig.hosts["a"].job(run_id, 1)
    old.stubborn = True
    rig.restart(run_id)
    rig.step(run_id)
    run = rig.run(run_id)
    assert run.status == "restarting" and run.message == f"restarting: processes {old.pids} still alive; trying again"
    assert rig.hosts["a"].verbs().count("launch") == 1, "the new attempt does not start beside the old one"
    old.stubborn = False
    rig.step(run_id)
    assert rig.run(run_id).status == "running" and rig.hosts["a"].job(run_id, 2).alive


def test_a_workspace_that_leads_to_the_root_on_its_host_fails_the_run_before_anything_is_written_there(
        rig: Rig) -> None:
    """The host's own answer decides (the path resolves elsewhere on this machine): refused at its first launch,
    naming the workspace, with no verb of the agent run there (the agent would be installed under it)."""
    host = rig.hosts["a"]
    host.real_paths["/ws"] = "/"
    run_id = rig.submit()
    rig.step(run_id, 2)
    run = rig.run(run_id)
    assert run.status == "failed" and "workspace '/ws' leads to / (its symlinks followed on the host)" in run.message
    assert host.verbs() == ["workspace"], "nothing launched, nothing installed"
    with rig.db.reading() as s:
        assert s.scalar(select(Host).where(Host.name == "a")).workspace_real == "/"


def test_a_backlog_of_metrics_is_stored_in_short_transactions_one_after_another(rig: Rig) -> None:
    run_id = rig.submit()
    rig.step(run_id, 2)
    host = rig.hosts["a"]
    job = host.job(run_id, 1)
    lines = 4 * INGEST_READ_BYTES // 40  # lines of 40 to 50 bytes
    host.write_metrics(job, *({"step": i, "loss": 1.0 / i} for i in range(1, lines + 1)))
    assert len(job.metrics) > 3 * INGEST_READ_BYTES
    stored, more = [], True
    while more:
        more = rig.supervisor.driver.step(run_id)  # True: the next step follows at once, not a tick later
        stored.append(rig.attempt(run_id, 1).metrics_lines)
    assert len(stored) >= 4 and stored[-1] == lines
    assert all(0 < b - a <= INGEST_READ_BYTES // 30 for a, b in zip([0, *stored], stored[:-1], strict=False)), \
        "each transaction stored at most INGEST_READ_BYTES of lines"
    assert [r["limit"] for verb, r in host.calls if verb == "probe"][-len(stored):] == [INGEST_READ_BYTES] * len(stored)
    assert rig.run(run_id).latest["step"] == lines and rig.run(run_id).status == "running"
