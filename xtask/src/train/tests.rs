//! `cargo xtask train` end to end: flags, checkpoints from the command line, the report.

use std::path::Path;

use super::{TrainArgs, run};

pub(crate) fn args(out: &Path, extra: &[&str]) -> TrainArgs {
    let out = out.to_str().expect("a UTF-8 temp path");
    let mut argv = vec!["train", "--out", out];
    argv.extend_from_slice(extra);
    TrainArgs::try_parse_words(argv).expect("flags parse")
}

/// Each bad flag is refused before any rank starts, naming the value, and leaves no run
/// directory behind.
#[test]
fn invalid_flags_fail_before_a_run_directory_exists() {
    let tmp = crate::temp_dir("zero-rs-train-flags-");
    let root = tmp.path().to_path_buf();
    // One row per documented bound and refusal (STATUS.md, "Input bounds"): the flags, and what
    // the error must name.
    let cases: &[(&[&str], &str)] = &[
        (&["--lr", "nan"], "lr"),
        (&["--lr=-1"], "lr"),
        (&["--timeout", "0"], "timeout"),
        (&["--stage", "4"], "stage"),
        (&["--steps", "0"], "steps"),
        // Any count up to u64::MAX is a valid run (stopped by the user): the refusal is the
        // next check's (steps are checked before the micro-batch).
        (
            &["--steps", "18446744073709551615", "--micro-batch", "0"],
            "micro_batch",
        ),
        (&["--micro-batch", "0"], "micro_batch"),
        (
            &["--world-size", "3", "--ranks-per-node", "2"],
            "ranks_per_node",
        ),
        (&["--world-size", "0"], "world_size"),
        (&["--world-size", "257"], "--world-size 257"),
        (&["--stage", "3", "--hpz", "3"], "hpz_partition_size"),
        // 2^20 tokens per rank per micro-step (the default model's sequences are 32 tokens).
        (&["--micro-batch", "40000"], "micro_batch"),
        // 2^24 tokens per rank per optimizer step.
        (
            &["--micro-batch", "8", "--grad-accum", "100000"],
            "gradient_accumulation_steps",
        ),
        (&["--precision", "fp8"], "precision"),
        (&["--model", "huge"], "--model"),
        (&["--backend", "tpu"], "--backend"),
        // Without the `cuda` feature: the build to use; with it, on this machine: no driver.
        (&["--backend", "cuda"], "cuda"),
        (&["--launcher", "slurm"], "--launcher"),
        // Outside `cargo xtask launch` (no torchrun variables): before any device is touched.
        (&["--launcher", "nccl"], "torchrun's variables"),
        (&["--data", "/nonexistent/zero-rs-data"], "--data"),
        (&["--config", "/nonexistent/zero-rs.toml"], "config"),
        (&["--resume", "/nonexistent/zero-rs-ckpt"], "resume"),
        (
            &["--init", "a.safetensors", "--resume", "b"],
            "--init and --resume",
        ),
    ];
    for (i, (flags, field)) in cases.iter().enumerate() {
        let out = root.join(format!("run-{i}"));
        let err = run(args(&out, flags)).expect_err("a bad flag fails");
        let msg = format!("{err:#}");
        assert!(msg.contains(field), "{flags:?}: {msg}");
        assert!(!out.exists(), "{flags:?} left {}", out.display());
    }
}

#[path = "../../tests/support/report_json.rs"]
mod report_json;

/// The run's first step and its losses as bits.
fn losses(dir: &Path) -> (u64, Vec<u32>) {
    let v = report_json::read(dir);
    (
        v["first_step"].as_u64().unwrap(),
        report_json::loss_bits(&v),
    )
}

/// `--save-every` saves every N steps and after the last; `--resume` continues bit-identically
/// up to `--steps` in all and saves into the same directory, beside a crashed save's staging;
/// another plan is refused without `--reshard` and resharded with it; `ckpt gc` keeps the
/// newest and removes the staging.
#[test]
fn save_resume_reshard_and_gc_from_the_command_line() {
    let tmp = crate::temp_dir("zero-rs-train-ckpt-");
    let root = tmp.path().to_path_buf();
    let tiny = ["--model", "tiny", "--micro-batch", "2"];
    fn with<'a>(tiny: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        [tiny, extra].concat()
    }
    let with = |extra: &[&'static str]| with(&tiny, extra);
    // `xtask train` into `out` with `extra` fails, its error naming `text`.
    let refused = |out: &std::path::Path, extra: &[&'static str], text: &str| {
        let e = run(args(out, &with(extra))).unwrap_err();
        assert!(format!("{e:#}").contains(text), "{e:#}");
    };
    let whole = root.join("whole");
    run(args(&whole, &with(&["--steps", "6"]))).unwrap();
    let first = root.join("first");
    run(args(&first, &with(&["--steps", "4", "--save-every", "2"]))).unwrap();
    let ck = first.join("checkpoints");
    let mut tags: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    tags.sort();
    assert_eq!(tags, ["step-00000002", "step-00000004"]);
    let ck_s: &'static str = Box::leak(ck.to_str().unwrap().to_owned().into_boxed_str());
    // What a rank killed inside the save of step 6 leaves (`zero-burn/tests/mpi/kill.rs` kills
    // one so): a staging directory with a torn rank file. The resume saves step 6 beside it.
    let crashed = ck.join(".staging-step-00000006-crashed");
    std::fs::create_dir(&crashed).unwrap();
    std::fs::write(crashed.join("rank-00001-of-00002.zrs"), b"torn").unwrap();
    let second = root.join("second");
    run(args(&second, &with(&["--steps", "6", "--resume", ck_s]))).unwrap();
    let (start, tail) = losses(&second);
    let (_, all) = losses(&whole);
    assert_eq!(start, 4);
    assert_eq!(
        tail,
        all[4..],
        "the resumed steps differ from the uninterrupted run"
    );
    // An older tag resumes too (its directory names it), into another --save-dir; into its
    // own root it would save step 6 again, which is refused before any rank starts.
    let tag2: &'static str = Box::leak(
        ck.join("step-00000002")
            .to_str()
            .unwrap()
            .to_owned()
            .into_boxed_str(),
    );
    let again = root.join("again");
    let again_ck: &'static str = Box::leak(
        again
            .join("ck")
            .to_str()
            .unwrap()
            .to_owned()
            .into_boxed_str(),
    );
    run(args(
        &again,
        &with(&["--steps", "6", "--resume", tag2, "--save-dir", again_ck]),
    ))
    .unwrap();
    let (start, tail) = losses(&again);
    assert_eq!(start, 2);
    assert_eq!(tail, all[2..], "the steps resumed from step 2 differ");
    let clash = ["--steps", "6", "--resume", tag2];
    refused(&root.join("clash"), &clash, "already holds step-00000006");
    assert!(
        !root.join("clash").exists(),
        "no run directory on a refusal"
    );
    // A fresh run does not take over another run's checkpoints (its LATEST stays), and a
    // resume with nothing left to train is refused up front; neither leaves a run directory.
    let latest = std::fs::read(ck.join("LATEST")).unwrap();
    let fresh = ["--steps", "2", "--save-every", "1", "--save-dir", ck_s];
    refused(&root.join("takeover"), &fresh, "another run's checkpoints");
    assert_eq!(std::fs::read(ck.join("LATEST")).unwrap(), latest);
    let done = ["--steps", "6", "--resume", ck_s];
    refused(&root.join("done"), &done, "nothing is left to train");
    for d in ["takeover", "done"] {
        assert!(!root.join(d).exists(), "{d}: no run directory on a refusal");
    }
    // Nothing goes inside a checkpoint: neither a --save-dir in a committed tag nor a run
    // directory (--out) in the root, even where the directory is yet to be made.
    let in_tag = ck.join("step-00000002").join("sub");
    let in_tag_s: &'static str = Box::leak(in_tag.to_str().unwrap().to_owned().into_boxed_str());
    let into = ["--steps", "2", "--save-every", "1", "--save-dir", in_tag_s];
    refused(&root.join("into-tag"), &into, "lies inside, the checkpoint");
    let e = run(args(&ck.join("a-run"), &with(&["--steps", "2"]))).unwrap_err();
    assert!(format!("{e:#}").contains("--out"), "{e:#}");
    assert!(
        format!("{e:#}").contains("lies inside, the checkpoint"),
        "{e:#}"
    );
    for d in [root.join("into-tag"), in_tag, ck.join("a-run")] {
        assert!(!d.exists(), "{}: made on a refusal", d.display());
    }
    // An odd world size needs no --ranks-per-node (one rank per node by default).
    run(args(
        &root.join("odd"),
        &with(&["--world-size", "1", "--steps", "1"]),
    ))
    .unwrap();
    // Another world without --reshard is refused, naming the plan; with it, it runs.
    let other = ["--world-size", "2", "--ranks-per-node", "1", "--steps", "7"];
    let e = run(args(
        &root.join("other"),
        &with(&[&other[..], &["--resume", ck_s]].concat()),
    ))
    .unwrap_err();
    assert!(format!("{e:#}").contains("plan"), "{e:#}");
    let resharded = root.join("resharded");
    run(args(
        &resharded,
        &with(&[&other[..], &["--resume", ck_s, "--reshard"]].concat()),
    ))
    .unwrap();
    assert_eq!(losses(&resharded).0, 6);
    crate::ckpt::gc(&ck, 1, false).unwrap();
    let left: Vec<String> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert_eq!(left, ["step-00000007"]);
    assert!(!crashed.exists(), "gc removes the crashed save's staging");
    assert!(run(args(&root.join("bad"), &with(&["--reshard"]))).is_err());
    // Fine-tuning from an export of the checkpoint; not together with --resume.
    let st = root.join("model.safetensors");
    let st_s: &'static str = Box::leak(st.to_str().unwrap().to_owned().into_boxed_str());
    let store = zero_burn::checkpoint::DirStorage::new(&ck).unwrap();
    let out = zero_burn::checkpoint::DirStorage::new(&root).unwrap();
    zero_burn::checkpoint::export_safetensors(
        &store,
        None,
        &out,
        "model.safetensors",
        zero_burn::checkpoint::ExportDtype::F32,
    )
    .unwrap();
    run(args(
        &root.join("init"),
        &with(&["--steps", "2", "--init", st_s]),
    ))
    .unwrap();
    let both = ["--init", st_s, "--resume", ck_s];
    refused(&root.join("both"), &both, "--init and --resume");
}

/// report.svg is well-formed XML (SVG) holding the loss line, its legend, the tokens/s of
/// each step and the memory bars; report.png decodes; report.json has one tokens/s figure per
/// step.
#[test]
fn the_report_figure_is_svg_with_the_loss_and_memory_bars() {
    let tmp = crate::temp_dir("zero-rs-train-svg-");
    let out = tmp.path().to_path_buf();
    run(args(
        &out,
        &["--model", "tiny", "--steps", "3", "--micro-batch", "2"],
    ))
    .unwrap();
    let text = std::fs::read_to_string(out.join("report.svg")).unwrap();
    let (mut texts, mut rects, mut lines, mut root) = (String::new(), 0, 0, None);
    for e in xml::reader::EventReader::from_str(&text) {
        match e.expect("report.svg is well-formed XML") {
            xml::reader::XmlEvent::StartElement { name, .. } => {
                root.get_or_insert_with(|| name.local_name.clone());
                match name.local_name.as_str() {
                    "rect" => rects += 1,
                    "polyline" | "path" => lines += 1,
                    _ => {}
                }
            }
            xml::reader::XmlEvent::Characters(c) => texts += &c,
            _ => {}
        }
    }
    assert_eq!(root.as_deref(), Some("svg"));
    for want in [
        "loss per step",
        "entropy floor",
        "throughput per step",
        "tokens/s (slowest rank)",
        "booked",
        "planned",
        "gradients",
    ] {
        assert!(
            texts.contains(want),
            "no {want:?} in the figure's text: {texts}"
        );
    }
    // 7 categories x 2 bars, plus legend boxes and the background.
    assert!(rects >= 14, "{rects} rectangles");
    assert!(lines >= 3, "{lines} lines");
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
    let per_step = v["step_tokens_per_sec"].as_array().unwrap();
    assert_eq!(per_step.len(), 3);
    assert!(
        per_step.iter().all(|t| t.as_f64().is_some_and(|t| t > 0.0)),
        "{per_step:?}"
    );
    // The same figure as a PNG, at the SVG's size, not blank.
    let (w, h, rgb) = crate::plot::tests::decode_png(&out.join("report.png"));
    assert_eq!((w, h), (1500, 420));
    let inked = rgb.chunks(3).filter(|p| p.iter().any(|&c| c < 200)).count();
    assert!(inked > 5_000, "{inked} inked pixels of {}", w * h);
}

/// `--offload-optimizer cpu` keeps the optimizer's state in host memory, `nvme` in the NVMe
/// store under `--nvme-path`: on the host backend the same bits as the default. The plan books
/// that state as host bytes, or (moments and master) as disk bytes; the report counts what the
/// store read and wrote, and no file stays behind.
#[test]
fn offloading_the_optimizer_changes_where_not_what() {
    let tmp = crate::temp_dir("zero-rs-train-offload-");
    let root = tmp.path().to_path_buf();
    let nvme = root.join("store");
    let nvme_flag = nvme.display().to_string();
    let base = [
        "--model",
        "tiny",
        "--steps",
        "2",
        "--micro-batch",
        "2",
        "--stage",
        "2",
        "--precision",
        "bf16",
        "--nvme-path",
        &nvme_flag,
    ];
    let mut results = Vec::new();
    for offload in ["none", "cpu", "nvme"] {
        let out = root.join(offload);
        let mut flags = base.to_vec();
        flags.extend(["--offload-optimizer", offload]);
        run(args(&out, &flags)).unwrap();
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
        let planned = &v["memory"]["planned"][0];
        let bytes = |key: &str| planned[key].as_u64().unwrap_or(0);
        let state = bytes("optimizer_states") + bytes("master_weights");
        let (host, disk) = match offload {
            "none" => (0, 0),
            "cpu" => (state + bytes("gradients"), 0),
            _ => (bytes("gradients") + bytes("offload_buffers"), state),
        };
        assert_eq!(
            (bytes("host_bytes"), bytes("disk_bytes")),
            (host, disk),
            "{offload}"
        );
        let io = &v["nvme_io_per_rank"][0];
        if offload == "nvme" {
            // Written at the build and after each of the 2 steps, read before each step.
            let (read, written) = (io["read_bytes"].as_u64(), io["written_bytes"].as_u64());
            assert!(
                read.unwrap() >= 2 * state && written.unwrap() >= 3 * state,
                "{io}"
            );
        } else {
            assert!(io.is_null(), "{offload}: {io}");
        }
        results.push(losses(&out));
    }
    assert_eq!(results[0], results[1], "cpu: the same losses, bit for bit");
    assert_eq!(results[0], results[2], "nvme: the same losses, bit for bit");
    let left: Vec<_> = std::fs::read_dir(&nvme)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "the store's files are removed: {left:?}");
}

/// `--offload-param cpu|nvme` at stage 3: the plan reports the shard as host or disk bytes, the
/// NVMe store's traffic is reported, and the losses are those of the shard in memory, bit for
/// bit.
#[test]
fn offloading_the_parameters_changes_where_not_what() {
    let tmp = crate::temp_dir("zero-rs-train-offload-param-");
    let root = tmp.path().to_path_buf();
    let nvme_flag = root.join("store").display().to_string();
    let mut results = Vec::new();
    for offload in ["none", "cpu", "nvme"] {
        let out = root.join(offload);
        let flags = [
            "--model",
            "tiny",
            "--steps",
            "2",
            "--stage",
            "3",
            "--precision",
            "bf16",
            "--nvme-path",
            &nvme_flag,
            "--offload-param",
            offload,
        ];
        run(args(&out, &flags)).unwrap();
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
        let planned = &v["memory"]["planned"][0];
        let bytes = |key: &str| planned[key].as_u64().unwrap_or(0);
        let placed = (bytes("host_bytes") > 0, bytes("disk_bytes") > 0);
        let want = (offload != "none", offload == "nvme");
        assert_eq!(placed, want, "{offload}: {planned}");
        let io = &v["nvme_io_per_rank"][0];
        assert_eq!(io.is_null(), offload != "nvme", "{offload}: {io}");
        results.push(losses(&out));
    }
    assert_eq!(results[0], results[1], "cpu: the same losses, bit for bit");
    assert_eq!(results[0], results[2], "nvme: the same losses, bit for bit");
}
