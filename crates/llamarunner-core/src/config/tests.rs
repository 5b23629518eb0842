//! The runner's settings checked: defaults, limits, and the errors a bad value gets.

use super::*;

fn with_model() -> RunnerConfig {
    RunnerConfig {
        model: "m.gguf".into(),
        ..RunnerConfig::default()
    }
}

#[test]
fn defaults_are_valid_once_a_model_is_set() {
    assert_eq!(
        RunnerConfig::default().validate(),
        Err(ConfigError::NoModel)
    );
    assert_eq!(with_model().validate(), Ok(()));
}

#[test]
fn out_of_range_values_are_named() {
    let cfg = RunnerConfig {
        parallel: 0,
        ..with_model()
    };
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("parallel"), "{err}");
    let cfg = RunnerConfig {
        kv_cache_type: "q5".into(),
        ..with_model()
    };
    assert!(matches!(cfg.validate(), Err(ConfigError::KvCacheType(_))));
    for (seed, ok) in [
        (-1, true),
        (0, true),
        (42, true),
        (4_294_967_295, true),
        (-2, false),
    ] {
        let cfg = RunnerConfig {
            seed,
            ..with_model()
        };
        assert_eq!(cfg.validate().is_ok(), ok, "{seed}");
    }
    let cfg = RunnerConfig {
        seed: 1 << 32,
        ..with_model()
    };
    assert!(cfg
        .validate()
        .unwrap_err()
        .to_string()
        .starts_with("seed must be"));
    let sampling = |temp, top_k, top_p, min_p| {
        RunnerConfig {
            temp,
            top_k,
            top_p,
            min_p,
            ..with_model()
        }
        .validate()
        .map_err(|e| e.to_string())
    };
    assert!(sampling(Some(0.0), Some(0), Some(1.0), Some(0.0)).is_ok());
    assert!(sampling(None, None, None, None).is_ok());
    for (bad, name) in [
        (sampling(Some(-0.1), None, None, None), "temp"),
        (sampling(Some(f32::NAN), None, None, None), "temp"),
        (sampling(None, Some(-1), None, None), "top-k"),
        (sampling(None, None, Some(1.5), None), "top-p"),
        (sampling(None, None, None, Some(-0.5)), "min-p"),
    ] {
        let err = bad.unwrap_err();
        assert!(err.starts_with(&format!("{name} must be")), "{err}");
    }
    // --n-predict: -1 (no default) or more.
    let n_predict = |n| {
        RunnerConfig {
            n_predict: Some(n),
            ..with_model()
        }
        .validate()
        .map_err(|e| e.to_string())
    };
    assert!(n_predict(-1).is_ok() && n_predict(0).is_ok() && n_predict(i32::MAX).is_ok());
    for bad in [-2, i32::MIN] {
        let err = n_predict(bad).unwrap_err();
        assert!(err.starts_with("n-predict must be"), "{err}");
    }
    // The penalties', Mirostat's and typical sampling's: the rules a request's values keep.
    let good = RunnerConfig {
        repeat_penalty: Some(1.1),
        repeat_last_n: Some(-1),
        presence_penalty: Some(-2.0),
        frequency_penalty: Some(2.0),
        mirostat: Some(2),
        mirostat_lr: Some(0.1),
        mirostat_ent: Some(5.0),
        typical: Some(1.0),
        ..with_model()
    };
    assert!(good.validate().is_ok());
    let defaults = good.sampling_defaults();
    assert_eq!(
        (defaults.mirostat_eta, defaults.mirostat_tau),
        (Some(0.1), Some(5.0))
    );
    assert_eq!(
        (defaults.typical_p, defaults.repeat_last_n),
        (Some(1.0), Some(-1))
    );
    let bad_ones: [(RunnerConfig, &str); 18] = [
        (
            RunnerConfig {
                repeat_penalty: Some(-1.0),
                ..good.clone()
            },
            "repeat-penalty",
        ),
        (
            RunnerConfig {
                repeat_penalty: Some(f32::INFINITY),
                ..good.clone()
            },
            "repeat-penalty",
        ),
        (
            RunnerConfig {
                repeat_last_n: Some(-2),
                ..good.clone()
            },
            "repeat-last-n",
        ),
        (
            RunnerConfig {
                presence_penalty: Some(f32::NAN),
                ..good.clone()
            },
            "presence-penalty",
        ),
        (
            RunnerConfig {
                frequency_penalty: Some(f32::NAN),
                ..good.clone()
            },
            "frequency-penalty",
        ),
        (
            RunnerConfig {
                mirostat: Some(3),
                ..good.clone()
            },
            "mirostat",
        ),
        (
            RunnerConfig {
                mirostat_lr: Some(-0.1),
                ..good.clone()
            },
            "mirostat-lr",
        ),
        (
            RunnerConfig {
                mirostat_ent: Some(f32::NAN),
                ..good.clone()
            },
            "mirostat-ent",
        ),
        (
            RunnerConfig {
                typical: Some(1.5),
                ..good.clone()
            },
            "typical",
        ),
        (
            RunnerConfig {
                dry_multiplier: Some(-0.5),
                ..good.clone()
            },
            "dry-multiplier",
        ),
        (
            RunnerConfig {
                dry_base: Some(f32::INFINITY),
                ..good.clone()
            },
            "dry-base",
        ),
        (
            RunnerConfig {
                dry_allowed_length: Some(-1),
                ..good.clone()
            },
            "dry-allowed-length",
        ),
        (
            RunnerConfig {
                dry_penalty_last_n: Some(-2),
                ..good.clone()
            },
            "dry-penalty-last-n",
        ),
        (
            RunnerConfig {
                xtc_probability: Some(1.5),
                ..good.clone()
            },
            "xtc-probability",
        ),
        (
            RunnerConfig {
                xtc_threshold: Some(f32::NAN),
                ..good.clone()
            },
            "xtc-threshold",
        ),
        (
            RunnerConfig {
                top_n_sigma: Some(f32::NAN),
                ..good.clone()
            },
            "top-n-sigma",
        ),
        (
            RunnerConfig {
                dynatemp_range: Some(11.0),
                ..good.clone()
            },
            "dynatemp-range",
        ),
        (
            RunnerConfig {
                dynatemp_exp: Some(-1.0),
                ..good.clone()
            },
            "dynatemp-exp",
        ),
    ];
    for (bad, name) in bad_ones {
        let err = bad.validate().unwrap_err().to_string();
        assert!(err.starts_with(&format!("{name} must be")), "{err}");
    }
}

#[test]
fn speculation_settings_are_bounded() {
    let check = |draft_max, draft_min, spec_ngram| {
        RunnerConfig {
            draft_max,
            draft_min,
            spec_ngram,
            ..with_model()
        }
        .validate()
        .map_err(|e| e.to_string())
    };
    assert!(check(0, 0, 1).is_ok());
    assert!(check(64, 64, 32).is_ok());
    assert!(check(0, 1, 3).is_ok(), "draft-min 1 with speculation off");
    for (max, min, ngram, name) in [
        (65, 1, 3, "draft-max"),
        (u32::MAX, 1, 3, "draft-max"),
        (4, 5, 3, "draft-min"),
        (8, 1, 0, "spec-ngram"),
        (8, 1, 33, "spec-ngram"),
    ] {
        let err = check(max, min, ngram).unwrap_err();
        assert!(err.contains(name), "{max} {min} {ngram}: {err}");
    }
}

#[test]
fn model_name_is_the_alias_or_the_file_stem() {
    let cfg = RunnerConfig {
        model: "/models/gemma-3-270m-q4_k_m.gguf".into(),
        ..RunnerConfig::default()
    };
    assert_eq!(cfg.model_name(), "gemma-3-270m-q4_k_m");
    let cfg = RunnerConfig {
        alias: Some("gemma".into()),
        ..cfg
    };
    assert_eq!(cfg.model_name(), "gemma");
}

#[test]
fn chat_template_must_be_builtin_or_a_file() {
    let cfg = RunnerConfig {
        chat_template: Some("gemma".into()),
        ..with_model()
    };
    assert_eq!(cfg.validate(), Ok(()));
    let cfg = RunnerConfig {
        chat_template: Some("/no/such/template.jinja".into()),
        ..with_model()
    };
    assert!(matches!(cfg.validate(), Err(ConfigError::ChatTemplate(_))));
}

#[test]
fn http_limits_and_durations_are_checked() {
    assert_eq!(with_model().max_body, 8 * 1024 * 1024);
    for (cfg, name) in [
        (
            RunnerConfig {
                max_body: 0,
                ..with_model()
            },
            "max-body",
        ),
        (
            RunnerConfig {
                max_connections: 0,
                ..with_model()
            },
            "max-connections",
        ),
        (
            RunnerConfig {
                header_timeout: 0.0,
                ..with_model()
            },
            "header-timeout",
        ),
        (
            RunnerConfig {
                idle_timeout: f64::NAN,
                ..with_model()
            },
            "idle-timeout",
        ),
        (
            RunnerConfig {
                shutdown_timeout: -1.0,
                ..with_model()
            },
            "shutdown-timeout",
        ),
        (
            RunnerConfig {
                timeout: f64::INFINITY,
                ..with_model()
            },
            "timeout",
        ),
        (
            RunnerConfig {
                timeout: 1e9,
                ..with_model()
            },
            "timeout",
        ),
    ] {
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.starts_with(&format!("{name} must be")), "{err}");
    }
    let zeros = RunnerConfig {
        shutdown_timeout: 0.0,
        timeout: 0.0,
        max_tokens: 0,
        header_timeout: 0.5,
        ..with_model()
    };
    assert_eq!(zeros.validate(), Ok(()));
    let cfg = RunnerConfig {
        allow_origin: vec![" ".into()],
        ..with_model()
    };
    assert_eq!(cfg.validate(), Err(ConfigError::EmptyOrigin));
}

#[test]
fn slot_save_path_must_be_a_directory_or_missing() {
    let file = temp_file("not-a-dir", "x");
    for (dir, why) in [
        (PathBuf::new(), "must not be empty"),
        (file.clone(), "not a directory"),
    ] {
        let cfg = RunnerConfig {
            slot_save_path: Some(dir),
            ..with_model()
        };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(
            err.starts_with("slot-save-path") && err.ends_with(why),
            "{err}"
        );
    }
    std::fs::remove_file(&file).unwrap();
    for dir in [std::env::temp_dir(), "/no/such/dir/yet".into()] {
        let cfg = RunnerConfig {
            slot_save_path: Some(dir),
            ..with_model()
        };
        assert_eq!(cfg.validate(), Ok(()));
    }
}

/// A file under the temp dir, unique to this test process and `name`.
fn temp_file(name: &str, text: &str) -> PathBuf {
    let path =
        std::env::temp_dir().join(format!("llamarunner-config-{}-{name}", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn api_keys_come_from_the_list_and_the_file() {
    assert_eq!(with_model().api_keys(), Ok(vec![]));
    let file = temp_file("keys", "# operators\n\n  key-two  \nkey-three\n# end\n");
    let cfg = RunnerConfig {
        api_key: vec!["key-one".into()],
        api_key_file: Some(file.clone()),
        ..with_model()
    };
    assert_eq!(cfg.validate(), Ok(()));
    assert_eq!(cfg.api_keys().unwrap(), ["key-one", "key-two", "key-three"]);
    std::fs::remove_file(&file).unwrap();

    for key in ["", "two words"] {
        let cfg = RunnerConfig {
            api_key: vec![key.into()],
            ..with_model()
        };
        assert_eq!(cfg.validate(), Err(ConfigError::BadApiKey), "{key:?}");
    }
    let missing = RunnerConfig {
        api_key_file: Some("/no/such/keys.txt".into()),
        ..with_model()
    };
    let err = missing.validate().unwrap_err().to_string();
    assert!(
        err.starts_with("api-key-file /no/such/keys.txt: cannot read"),
        "{err}"
    );
    let empty = temp_file("empty-keys", "# nothing yet\n\n");
    let cfg = RunnerConfig {
        api_key_file: Some(empty.clone()),
        ..with_model()
    };
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.ends_with("no key in it"), "{err}");
    std::fs::remove_file(&empty).unwrap();
}

#[test]
fn http_settings_deserialize_from_json() {
    let cfg: RunnerConfig = serde_json::from_str(
        r#"{"model":"m","api_key":["a","b"],"allow_origin":["*"],"max_body":1024,
            "max_connections":4,"header_timeout":2.5,"idle_timeout":30,
            "shutdown_timeout":0,"max_tokens":100,"timeout":60}"#,
    )
    .unwrap();
    assert_eq!(cfg.api_key, ["a", "b"]);
    assert_eq!(cfg.allow_origin, ["*"]);
    assert_eq!((cfg.max_body, cfg.max_connections), (1024, 4));
    assert_eq!((cfg.header_timeout, cfg.idle_timeout), (2.5, 30.0));
    assert_eq!((cfg.max_tokens, cfg.timeout), (100, 60.0));
    assert_eq!(cfg.validate(), Ok(()));
}

#[test]
fn unknown_json_fields_are_rejected() {
    // A bad value names its setting.
    for (json, name) in [
        (r#"{"model":"m","draft_max":-1}"#, "--draft-max: "),
        (r#"{"model":"m","draft_min":-3}"#, "--draft-min: "),
        (r#"{"model":"m","spec_ngram":"x"}"#, "--spec-ngram: "),
        (r#"{"model":"m","parallel":-1}"#, "--parallel: "),
    ] {
        let e = RunnerConfig::from_json(json).unwrap_err();
        assert!(e.starts_with(name), "{e}");
    }
    assert!(RunnerConfig::from_json(r#"{"model":"m"}"#).is_ok());
    let r: Result<RunnerConfig, _> = serde_json::from_str(r#"{"model":"m","bogus":1}"#);
    assert!(r.is_err());
    let r: RunnerConfig = serde_json::from_str(r#"{"model":"m","flash_attn":"on"}"#).unwrap();
    assert_eq!(r.flash_attn, FlashAttn::On);
    assert_eq!(r.parallel, 1);
    assert_eq!((r.log_format, r.no_metrics), (LogFormat::Text, false));
    let r: RunnerConfig =
        serde_json::from_str(r#"{"model":"m","log_format":"json","no_metrics":true}"#).unwrap();
    assert_eq!((r.log_format, r.no_metrics), (LogFormat::Json, true));
    let r: Result<RunnerConfig, _> = serde_json::from_str(r#"{"model":"m","log_format":"xml"}"#);
    assert!(r.is_err());
}

#[test]
fn reasoning_format_is_auto_or_none() {
    let r: RunnerConfig = serde_json::from_str(r#"{"model":"m"}"#).unwrap();
    assert_eq!(r.reasoning_format, ReasoningFormat::Auto);
    let r: RunnerConfig =
        serde_json::from_str(r#"{"model":"m","reasoning_format":"none"}"#).unwrap();
    assert_eq!(r.reasoning_format, ReasoningFormat::None);
    let r: Result<RunnerConfig, _> =
        serde_json::from_str(r#"{"model":"m","reasoning_format":"deepseek"}"#);
    assert!(r.is_err());
}

#[test]
fn reasoning_is_auto_on_or_off() {
    let r: RunnerConfig = serde_json::from_str(r#"{"model":"m"}"#).unwrap();
    assert_eq!(r.reasoning, Reasoning::Auto);
    for (text, want) in [("on", Reasoning::On), ("off", Reasoning::Off)] {
        let r: RunnerConfig =
            serde_json::from_str(&format!(r#"{{"model":"m","reasoning":"{text}"}}"#)).unwrap();
        assert_eq!(r.reasoning, want);
    }
    let r: Result<RunnerConfig, _> = serde_json::from_str(r#"{"model":"m","reasoning":"maybe"}"#);
    assert!(r.is_err());
}

#[test]
fn reasoning_defaults_thinking_by_template() {
    let reads =
        crate::chat::ChatTemplate::new("t", "{% if enable_thinking %}think{% endif %}", "", "")
            .unwrap();
    let plain = crate::chat::ChatTemplate::new("t", "{{ messages }}", "", "").unwrap();
    assert_eq!(Reasoning::Auto.default_thinking(&reads), Some(true));
    assert_eq!(Reasoning::Auto.default_thinking(&plain), None);
    assert_eq!(Reasoning::On.default_thinking(&plain), Some(true));
    assert_eq!(Reasoning::Off.default_thinking(&reads), Some(false));
}

#[test]
fn deterministic_mode_refuses_what_it_does_not_cover() {
    let det = || RunnerConfig {
        deterministic: true,
        ..with_model()
    };
    assert_eq!(det().validate(), Ok(()));
    assert_eq!(det().effective_flash_attn(), FlashAttn::Off);
    for (cfg, named) in [
        (
            RunnerConfig {
                flash_attn: FlashAttn::On,
                ..det()
            },
            "--flash-attn on",
        ),
        (
            RunnerConfig {
                n_gpu_layers: 3,
                ..det()
            },
            "--n-gpu-layers",
        ),
        (
            RunnerConfig {
                tensor_split: Some("1".into()),
                ..det()
            },
            "--tensor-split",
        ),
        (
            RunnerConfig {
                mmproj: Some("p.gguf".into()),
                ..det()
            },
            "--mmproj",
        ),
        (
            RunnerConfig {
                batch_size: 3,
                ..det()
            },
            "--batch-size",
        ),
        (
            RunnerConfig {
                null_decode: true,
                ..det()
            },
            "--null-decode",
        ),
        (
            RunnerConfig {
                kv_cache_type: "q8_0".into(),
                ..det()
            },
            "--kv-cache-type",
        ),
    ] {
        let err = cfg.validate().unwrap_err();
        assert!(matches!(err, ConfigError::Deterministic(_)), "{err}");
        let text = err.to_string();
        assert!(
            text.starts_with("--deterministic cannot run with"),
            "{text}"
        );
        assert!(text.contains(named), "{text}");
    }
    // Without the mode, the same settings are accepted (the flash attention one included).
    let cfg = RunnerConfig {
        flash_attn: FlashAttn::On,
        batch_size: 3,
        ..with_model()
    };
    assert_eq!(cfg.validate(), Ok(()));
}
