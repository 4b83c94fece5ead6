"""cases: the golden case catalogue (what each case is; golden.py stores and checks them)."""

from attnexport import cases


def test_every_variant_and_scaling_mode_has_a_case():
    from attnexport import variants as V
    covered = {c.variant for c in cases.CASES.values()}
    assert covered == set(V.VARIANTS)
    for mode in ("sqrt", "none", "norm", "cosine", "length"):
        assert any(c.options.get("scaling") == mode for c in cases.CASES.values())


def test_seeds_come_from_names_not_positions():
    seeds = {name: c.case_seed for name, c in cases.CASES.items()}
    assert seeds["mha-seeded"] == cases.seed_of("mha-seeded") and len(set(seeds.values())) > 30


def test_provenance_lines_name_the_source_file():
    assert cases.provenance_line(cases.CASES["kernel-nadaraya-watson"]) == "worked example, " + cases.SRC_KERNEL
    assert cases.provenance_line(cases.CASES["mha-seeded"]) == "seeded"
    assert cases.provenance_line(cases.CASES["additive-valid-lens"]).startswith("seeded, built on ")
