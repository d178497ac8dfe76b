#!/usr/bin/env python3
"""Renders benches/RESULTS.md from the figures benches/run collected.

usage: report.py RESULTS_DIR CRITERION_DIR > benches/RESULTS.md
"""

import datetime
import json
import os
import re
import sys

res, crit = sys.argv[1], sys.argv[2]


def load(name):
    try:
        with open(os.path.join(res, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def text(name, default=""):
    try:
        with open(os.path.join(res, name)) as f:
            return f.read().strip()
    except OSError:
        return default


# The previous RESULTS.md: sections other suites write (kept as they are), and the rows of
# measurements this run skipped (BENCH_SKIP), carried over and marked as such.
try:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS.md")) as f:
        old = f.read()
except OSError:
    old = ""
old_date = next((l.split(" on ", 1)[1].split(",")[0] for l in old.splitlines()
                 if l.startswith("Produced by")), "an earlier run")
carried = []


def carry(prefix):
    """The previous run's rows starting with `prefix`, marked as carried over."""
    for l in old.splitlines():
        if l.startswith("| " + prefix):
            if "carried over from " in l:
                # Carried over already: it keeps the date of the run that measured it.
                rows.append(l.rstrip())
            elif l.rstrip().endswith("|"):
                rows.append(l.rstrip()[:-1].rstrip() + " carried over from " + old_date + " |")
            else:
                rows.append(l.rstrip() + " (carried over) |")
            carried.append(prefix)


def old_section(title):
    start = old.find("## " + title)
    if start < 0:
        return None
    end = old.find("\n## ", start + 1)
    return old[start:end if end >= 0 else len(old)].rstrip()


perf = load("perf.json") or {}
rpc = load("rpc.json")
download = load("download.json")
status = load("status.json")
upgrade = load("upgrade.json")
fleet = load("fleet.json")
rows = []


def ms(s):
    return f"{s['median']:.1f} ms (min {s['min']:.1f}, max {s['max']:.1f}, n={s['n']})"


def loads(v):
    la = v.get("load") if isinstance(v, dict) else None
    return f"{la[0]:.1f}→{la[1]:.1f}" if la else ""


def verdict(ok):
    return "met" if ok else "**missed**"


def row(what, result, target, ratio, ok, la):
    rows.append(f"| {what} | {result} | {target} | {ratio} | {verdict(ok) if ok is not None else ''} | {la} |")


for key, label in (("apply4k", "500 files of 4 KiB"), ("apply1m", "50 files of 1 MiB"),
                   ("apply1mReplace", "50 files of 1 MiB onto 50 existing ones (each backed up)")):
    a = perf.get(key)
    # Replacing existing files has no target of its own: it shows what the backups cost.
    target = "" if key == "apply1mReplace" else "≤ 1.25× baseline"
    if a:
        def ratio(r):
            return f"{r['median']:.2f}× (rounds {r['min']:.2f}–{r['max']:.2f})"
        if "ratioJson" in a:
            for front, k, rk in (("`apply` of a JSON plan", "agentJson", "ratioJson"),
                                 ("`submit --wait` over gRPC (mTLS, running `serve`; the file streamed: `SubmitPlanDocument`)", "agentGrpc", "ratioGrpc")):
                row(f"apply {label} vs raw atomic writes: {front}",
                    f"agent {ms(a[k])}; baseline {ms(a['baseline'])}",
                    target, ratio(a[rk]), a[rk]["median"] <= 1.25 if target else None, loads(a))
            row(f"apply {label}: `apply` of the same plan as YAML (what YAML costs on top)",
                f"agent {ms(a['agent'])}; {a['agent']['median'] - a['agentJson']['median']:+.1f} ms against JSON",
                "", ratio(a["ratio"]), None, loads(a))
        else:
            r = a["ratio"]
            row(f"apply {label} vs raw atomic writes",
                f"agent {ms(a['agent'])}; baseline {ms(a['baseline'])}",
                "≤ 1.25× baseline", ratio(r), r["median"] <= 1.25, loads(a))
a = perf.get("apply1m")
if a and a.get("agentPeakRssJsonKiB") and a.get("planBytes"):
    limit = 1.5 * a["planBytes"] / 1024 + 16 * 1024
    row(f"peak RSS of `apply` of the 50×1 MiB plan ({a['planBytes'] / 2**20:.1f} MiB as JSON)",
        f"JSON {a['agentPeakRssJsonKiB'] / 1024:.1f} MiB; YAML {(a.get('agentPeakRssKiB') or 0) / 1024:.1f} MiB",
        f"≤ 1.5× plan + 16 MiB ({limit / 1024:.0f} MiB)", "",
        a["agentPeakRssJsonKiB"] <= limit, "")
n = perf.get("noop")
if n:
    row("no-op re-apply, 500 files, same desired state under a new id (diffs every file, journals the plan)",
        ms(n["newId"]) + f" ({n['tool']})", "≤ 50 ms", "", n["newId"]["median"] <= 50, loads(n))
    if "newIdJson" in n:
        row("the same no-op re-apply with the plan as JSON (plain content) instead of YAML",
            ms(n["newIdJson"]) + f" ({n['tool']})", "≤ 50 ms", "", n["newIdJson"]["median"] <= 50, loads(n))
    row("no-op re-apply, 500 files, the same plan again (already succeeded: parse, digest, journal replay)",
        ms(n["samePlan"]), "≤ 50 ms", "", n["samePlan"]["median"] <= 50, loads(n))
nl = perf.get("noopLarge")
if nl:
    row(f"no-op re-apply, {nl['files']} files of {nl['size'] / 2**20:.0f} MiB, under a new id (JSON; contents held by their files, none written)",
        ms(nl["newId"]) + f"; first apply {nl['firstMs']:.1f} ms; {nl['blobsStored']} blobs stored",
        "", "", None, loads(nl))
an = perf.get("ansible")
if an and "skipped" not in an:
    for k, label in (("first", "first apply"), ("noop", "no-op re-apply")):
        r = an[f"{k}Ratio"]
        A = an["ansibleFirst" if k == "first" else "ansibleNoop"]
        G = an["agentFirst" if k == "first" else "agentNoop"]
        row(f"Ansible `copy` vs agent, 500 files, {label} ({an['runs']} round)",
            f"Ansible {A['median'] / 1000:.1f} s; agent {G['median']:.1f} ms",
            "agent ≥ 20× faster", f"{r['median']:.0f}× faster", r["median"] >= 20, loads(an))
elif an and "skipped" in an and "Ansible `copy`" in old:
    carry("Ansible `copy`")
elif an:
    row("Ansible comparison", "skipped: " + an["skipped"], "", "", None, "")
for key, target in (("replay100k", None), ("replay1m", 1500)):
    r = perf.get(key)
    if r:
        row(f"replay a journal of {r['records']:,} records ({r['bytes'] / 2**20:.0f} MiB) into the engine's state",
            ms(r["time"]), f"≤ {target} ms" if target else "", "",
            (r["time"]["median"] <= target) if target else None, loads(r))
j = perf.get("journalSize")
if j:
    row(f"journal on disk after {j['plans']:,} plans (10 files each), compaction on",
        f"{j['bytes'] / 1024:.0f} KiB, {j['records']} records (peak {j['peakBytes'] / 1024:.0f} KiB; "
        f"{j['compactions']} compactions; {j['msPerPlan']:.1f} ms per plan)", "", "", None, loads(j))
fp = perf.get("footprint")
if fp:
    stripped = fp.get("strippedBytes") or fp["binaryBytes"]
    row("stripped binary", f"{stripped / 2**20:.1f} MiB", "≤ 15 MiB", "", stripped <= 15 * 2**20, loads(fp))
    row("start-up: spawn → sd_notify READY=1, empty state", ms(fp["startupEmpty"]), "≤ 50 ms", "",
        fp["startupEmpty"]["median"] <= 50, loads(fp))
    row(f"start-up: spawn → READY=1, {fp['journalRecords']:,}-record journal", ms(fp["startupJournal"]),
        "≤ 50 ms", "", fp["startupJournal"]["median"] <= 50, loads(fp))
    m = fp["idleRssKiB"]
    row(f"idle RSS of `serve` (mTLS listener, {fp['journalRecords']:,}-record journal), 15 s after ready",
        f"{m['rss'] / 1024:.1f} MiB (anon {m['anon'] / 1024:.1f}, file {m['file'] / 1024:.1f}, Pss {m['pss'] / 1024:.1f}; peak {m['peak'] / 1024:.1f})",
        "≤ 8 MiB", "", m["rss"] <= 8192, loads(fp))
di = perf.get("driftIdle")
if di:
    # Issue 37: no measurable change to idle RSS, and still at most 8 MiB. "Measurable": more
    # than 2 % over `--no-drift-checks` in the same rounds (rounds of one binary differ by
    # about that much).
    a, b = di["watchingKiB"], di["offKiB"]
    row(f"idle RSS of `serve` on a node where a {di['files']}-file plan succeeded: drift watching on "
        f"(start-up check done in a check process, inotify) vs `--no-drift-checks`, 15 s after ready",
        f"watching {a['median'] / 1024:.2f} MiB (anon {di['watchingAnonKiB']['median'] / 1024:.2f}; "
        f"min {a['min'] / 1024:.2f}, max {a['max'] / 1024:.2f}, n={a['n']}); "
        f"off {b['median'] / 1024:.2f} MiB (anon {di['offAnonKiB']['median'] / 1024:.2f})",
        "≤ 8 MiB and ≤ 1.02× off", f"{di['ratio']['median']:.3f}×",
        a["median"] <= 8192 and di["ratio"]["median"] <= 1.02, loads(di))


def crit_median_ns(group, bench):
    """The median of a Criterion benchmark's last run, in ns (None when it did not run)."""
    try:
        with open(os.path.join(crit, group, bench, "new", "estimates.json")) as f:
            return json.load(f)["median"]["point_estimate"]
    except (OSError, ValueError, KeyError):
        return None


check, plan_ns = (crit_median_ns("drift-500x4KiB", b) for b in ("drift-check", "check-plan"))
if check and plan_ns:
    # The budget of a check of a 500-file plan that has not drifted (issue 37): 1 ms, which
    # metadata first keeps (the stamps of 502 paths); the dry run it saves is the baseline.
    row("drift check of a 500×4 KiB plan the node still matches, metadata first, vs the dry run "
        "of the same plan (`CheckPlan`'s code), in-process (Criterion)",
        f"{check / 1e6:.2f} ms; dry run {plan_ns / 1e6:.2f} ms", "≤ 1 ms",
        f"{check / plan_ns:.3f}×", check <= 1e6, "")
full, probe = (crit_median_ns("drift-500x4KiB", b)
               for b in ("drift-check-full", "drift-check-full-in-a-process"))
if full and probe:
    row("full drift check of the 500×4 KiB plan (one file's metadata changed): in a check process "
        "(`serve --drift-probe`, as the daemon makes it) vs in-process (Criterion)",
        f"{probe / 1e6:.1f} ms; in-process {full / 1e6:.1f} ms", "", f"{probe / full:.2f}×", None, "")
if rpc is None:
    for prefix in ("idle RSS of `serve` after", "`GetPlanStatus` over mTLS", "new mTLS connections"):
        carry(prefix)
if rpc:
    m = rpc["rssKiB"]
    row(f"idle RSS of `serve` after {rpc['plans']['count']:,} plans over gRPC",
        f"{m['idle'] / 1024:.1f} MiB (anon {m['idleAnon'] / 1024:.1f}, file {m['idleFile'] / 1024:.1f}; peak {m['peak'] / 1024:.1f})",
        "≤ 8 MiB", "", m["idle"] <= 8192, "")
    g = rpc["getPlanStatus"]
    row(f"`GetPlanStatus` over mTLS, one connection, {g['calls']:,} calls",
        f"p50 {g['p50Micros']:.0f} µs, p99 {g['p99Micros']:.0f} µs, max {g['maxMicros'] / 1000:.1f} ms ({g['callsPerSecond']:.0f} calls/s)",
        "", "", None, "")
    row("new mTLS connections per second (handshake + HTTP/2 + one call)", f"{rpc['connectionsPerSecond']:.0f}/s",
        "", "", None, "")
    ab = rpc.get("abuse")
    if ab:
        row(f"{ab['requests']} concurrent `CheckPlan`s of {ab['requestBytes'] / 2**20:.0f} MiB, one connection each: peak RSS",
            f"{ab['peakKiB'] / 1024:.1f} MiB ({ab['answered']} answered, {ab['busy']} told busy, in {ab['seconds']:.1f} s)",
            "≤ 64 MiB", "", ab["peakKiB"] <= 64 * 1024, "")
        row("... then RSS back under 16 MiB",
            f"{ab['rssAfterKiB'] / 1024:.1f} MiB (anon {ab['anonAfterKiB'] / 1024:.1f}) after {ab['backUnder16MiBAfterSeconds']:.1f} s",
            "≤ 16 MiB within 60 s", "", ab["rssAfterKiB"] <= 16 * 1024 and ab["backUnder16MiBAfterSeconds"] <= 60, "")
if status is None:
    for prefix in ("`GET /v1/status`", "RSS of `serve` with the status socket"):
        carry(prefix)
if status:
    l, m, j = status["statusLatency"], status["rssKiB"], status["journal"]
    row(f"`GET /v1/status` over the socket at {l['rate']:,}/s (open loop, {l['requests']:,} requests, {l['failed']} failed)",
        f"from the scheduled start: p50 {l['p50Micros']:.0f} µs, p99 {l['p99Micros']:.0f} µs, max {l['maxMicros'] / 1000:.1f} ms"
        + (f"; from the request's actual start: p50 {l['serviceP50Micros']:.0f} µs, p99 {l['serviceP99Micros']:.0f} µs"
           if "serviceP50Micros" in l else ""),
        "", "", None, "")
    row(f"RSS of `serve` with the status socket, metrics and a {j['records']:,}-record journal, after that load",
        f"{m['afterLoad'] / 1024:.1f} MiB (anon {m['afterLoadAnon'] / 1024:.1f}, file {m['afterLoadFile'] / 1024:.1f}; "
        f"at start {m['start'] / 1024:.1f}; peak {m['peak'] / 1024:.1f})",
        "≤ 8 MiB", "", m["afterLoad"] <= 8192, "")
if upgrade is None:
    carry("version bump")
elif upgrade and "skipped" in upgrade:
    row("version bump 1.30 → 1.31 on a sandboxed real systemd", f"skipped: {upgrade['skipped']}", "", "", None, "")
elif upgrade:
    parts = ", ".join(f"{f['name']} {f['medianMs']:.0f} ms" for f in upgrade["figures"][1:] if f["depth"] == 1)
    total = next(f for f in upgrade["figures"] if f["name"].startswith("accepted → Succeeded"))
    row(f"version bump 1.30 → 1.31 ({upgrade['manager']}) on a sandboxed real systemd, accepted → Succeeded ({upgrade['rounds']} rounds)",
        f"{total['medianMs']:.0f} ms (min {total['minMs']:.0f}, max {total['maxMs']:.0f}); {parts}",
        "", "", None, "")
    noop = next((f for f in upgrade["figures"] if f["name"].startswith("no-op re-apply")), None)
    if noop:
        row("version bump plan applied again under a new id (nothing to do: no package command, no restart)",
            f"{noop['medianMs']:.0f} ms (min {noop['minMs']:.0f}, max {noop['maxMs']:.0f})", "", "", None, "")
if download is None:
    carry("artifact download")
if download:
    row(f"artifact download, {download['mib']} MiB over TLS from 127.0.0.1 ({download['rounds']} rounds)",
        f"{download['oursMiBps']:.0f} MiB/s (curl {download['curlMiBps']:.0f} MiB/s)", "≥ 0.9× curl",
        f"{download['ratio']:.2f}× (rounds {download['ratioMin']:.2f}–{download['ratioMax']:.2f})",
        download["ratio"] >= 0.9, "")
if fleet is None:
    carry("fleet:")
if fleet:
    u = fleet["updater"]
    a = fleet["agentsKiB"]
    row(f"fleet: {fleet['agents']} agents, one updater ({fleet['concurrency']} at a time), plan submitted → all SUCCEEDED",
        f"{u['wallSeconds']:.1f} s ({u['succeeded']} succeeded, {u['failed']} failed; per agent p50 "
        f"{u['perAgentMillis']['p50']:.0f} ms, p99 {u['perAgentMillis']['p99']:.0f} ms)",
        "≤ 30 s", "", u["wallSeconds"] <= 30 and u["failed"] == 0, "")
    row("fleet: every agent's RSS, idle after the plan",
        f"max {a['rssMax'] / 1024:.1f} MiB (anon max {a['anonMax'] / 1024:.1f}, file max {a['fileMax'] / 1024:.1f}); "
        f"{a['over8MiB']} agents over 8 MiB",
        "each ≤ 8 MiB", "", a["over8MiB"] == 0, "")
    row("fleet: sum of the agents' memory",
        f"RSS {a['rssSum'] / 2**20:.2f} GiB (anon {a['anonSum'] / 2**20:.2f} GiB); Pss {a['pssSum'] / 2**20:.2f} GiB; "
        f"{a['threads']} threads", "", "", None, "")
    row("fleet: the updater's memory", f"peak RSS {u['peakRssKiB'] / 1024:.1f} MiB", "", "", None, "")


def criterion_rows():
    out = []
    if not os.path.isdir(crit):
        return out
    for group in sorted(os.listdir(crit)):
        gdir = os.path.join(crit, group)
        if not os.path.isdir(gdir) or group == "report":
            continue
        for bench in sorted(os.listdir(gdir)):
            est = os.path.join(gdir, bench, "new", "estimates.json")
            meta = os.path.join(gdir, bench, "new", "benchmark.json")
            if not os.path.exists(est):
                continue
            with open(est) as f:
                e = json.load(f)
            thr = None
            try:
                with open(meta) as f:
                    thr = json.load(f).get("throughput")
            except (OSError, ValueError):
                pass
            med = e["median"]
            ci = med["confidence_interval"]

            def t(ns):
                return f"{ns / 1e6:.2f} ms" if ns >= 1e5 else f"{ns / 1e3:.1f} µs"
            extra = ""
            if thr and "Bytes" in thr:
                extra = f"{thr['Bytes'] / (med['point_estimate'] / 1e9) / 2**20:.0f} MiB/s"
            elif thr and "Elements" in thr:
                extra = f"{med['point_estimate'] / thr['Elements']:.0f} ns per record"
            out.append(f"| {group}/{bench} | {t(med['point_estimate'])} ({t(ci['lower_bound'])} – {t(ci['upper_bound'])}) | {extra} |")
    return out


machine = perf.get("machine", {})
commit = text("commit.txt", "unknown").split()
print("# Benchmark results")
print()
print(f"Produced by `benches/run` on {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}, "
      f"commit {commit[0]}{' (with uncommitted changes)' if 'dirty' in commit else ''}; "
      f"the suite took {int(text('seconds.txt', '0')) // 60} min.")
print()
if machine:
    print(f"Machine: {machine['cores']} cores ({machine['cpu']}), {machine['memGiB']:.0f} GiB, Linux {machine['kernel']}. "
          f"Load average (1, 5, 15 min) at the start: {text('load-start.txt')}; at the end: {text('load-end.txt')}.")
print()
print("Each figure is the median of several runs with its spread (min, max, n). Comparisons are measured")
print("side by side in the same run (who goes first alternates) and the ratio is the median of the rounds'")
print("ratios. The last column is the 1-minute load average before → after the measurement. How each")
print("figure is measured: `benches/README.md`.")
print()
print("| measurement | result | target | ratio | | load |")
print("|---|---|---|---|---|---|")
for r in rows:
    print(r)
if carried:
    print()
    print(f"Rows whose last column says *carried over* were not measured in this run (skipped with "
          f"`BENCH_SKIP`): they are the figures of the run they name, for code before this run's commit.")
cr = criterion_rows()
if cr:
    print()
    print("## Micro-benchmarks (Criterion, in-process)")
    print()
    print("| benchmark | median (95% CI) | throughput |")
    print("|---|---|---|")
    for r in cr:
        print(r)
if fleet is None and old_section("Fleet details"):
    # The fleet's own lines, under the date of the run that measured them (a section carried
    # over before keeps its first date); the per-run lines after them are printed anew below.
    head, _, body = old_section("Fleet details").partition("\n")
    dates = re.findall(r"\(carried over from ([^)]*)\)", head)
    again = ("Peak RSS of one `apply`",) + (("Ansible: ",) if text("ansible-version.txt") else ())
    kept = [l for l in body.split("\n") if not l.startswith(again)]
    print()
    print("## Fleet details (carried over from " + (dates[-1] if dates else old_date) + ")")
    print(re.sub(r"\n{3,}", "\n\n", "\n".join(kept)).rstrip())
if fleet:
    print()
    print("## Fleet details")
    print()
    s = fleet["startupMillis"]
    print(f"{fleet['agents']} agents started (8 at a time) in {fleet['startAllSeconds']:.1f} s; spawn → READY=1 per agent "
          f"p50 {s['p50']:.0f} ms, p99 {s['p99']:.0f} ms, max {s['max']:.0f} ms. {fleet['alive']} agents alive at the end.")
if perf.get("apply4k", {}).get("agentPeakRssKiB"):
    print()
    print(f"Peak RSS of one `apply` of the 500-file plan (`/usr/bin/time -v`): "
          f"{perf['apply4k']['agentPeakRssKiB'] / 1024:.1f} MiB; of the 50×1 MiB plan: "
          f"{(perf.get('apply1m', {}).get('agentPeakRssKiB') or 0) / 1024:.1f} MiB.")
av = text("ansible-version.txt")
if av:
    print()
    print(f"Ansible: {av}.")
# Sections written by hand (what the targets' figures mean) or by suites run on their own (the
# updater under CAPI's load, memory under abuse, about an hour of power cuts under software
# emulation): kept as they are.
for title in ("Where the write-once and footprint targets stand", "Audit of the performance mechanisms",
              "Updater", "Whole clusters in place", "Memory under abuse",
              "Power cuts on a VM node", "Drift checks"):
    section = old_section(title)
    if section:
        print()
        print(section)
