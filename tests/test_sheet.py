"""Contact sheets (``convnets predict --show FILE.png``, :mod:`convnets.inference.sheet`): PNGs read back with PIL,
tiles found by geometry and checked against independently computed thumbnails; the CLI in real subprocesses."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import LoopbackServer, REPO, Route, TINY, command_lines, randomize_bn, run_cli
from PIL import Image, ImageOps

import convnets
from convnets.errors import ImageNotFoundError, InvalidArgumentError, UnknownArgumentError
from convnets.inference.loader import Decoding
from convnets.inference.predict import Prediction, TopClass, iter_predict
from convnets.inference.sheet import ContactSheetWriter, check_sheet_destination, sheet_path, write_contact_sheets
from convnets.preprocessing.presets import DEFAULT_PRESET

SIDE, GAP = 256, 8  # the writer's defaults: thumbnail square and white space
PAPER, FRAME, FAILED = (255, 255, 255), (236, 236, 236), (250, 222, 222)
EXAMPLES = REPO / "convnets" / "assets" / "examples"
LONG_LABEL = ("cash machine, cash dispenser, automated teller machine, automatic teller machine, automated teller, "
              "automatic teller, ATM")


def _color(i: int) -> tuple[int, int, int]:
    """A distinct colour per image (no channel closer than 2 to another image's)."""
    return (10 + 3 * i, 240 - 3 * i, (40 + 97 * i) % 256)


def _solid_images(folder: Path, count: int) -> list[Path]:
    """``count`` 40x30 PNGs, one colour each: their thumbnails are 256x192, filled with that colour."""
    folder.mkdir(exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"img{i:03d}.png"
        Image.new("RGB", (40, 30), _color(i)).save(path)
        paths.append(path)
    return paths


def _prediction(path: Path | str, k: int = 3) -> Prediction:
    labels = [LONG_LABEL, "tabby, tabby cat", "x"]
    return Prediction(str(path), [TopClass(c, labels[c % 3], p) for c, p in zip(range(k), (0.7, 0.2, 0.1))])


def _grid(sheet: Image.Image, tiles: int, columns: int = 8) -> tuple[int, int, int]:
    """``(columns, rows, tile height)`` checked against the sheet's size: the width is exactly the columns'
    squares and gaps; the tile height is what the rows leave."""
    columns = min(columns, tiles)
    rows = -(-tiles // columns)
    assert sheet.width == GAP + columns * (SIDE + GAP)
    tile_height, rest = divmod(sheet.height - GAP, rows)
    assert rest == 0
    return columns, rows, tile_height - GAP


def _square(sheet: np.ndarray, index: int, columns: int, tile_height: int) -> np.ndarray:
    """The thumbnail square of tile ``index`` (row-major)."""
    row, column = divmod(index, columns)
    top, left = GAP + row * (tile_height + GAP), GAP + column * (SIDE + GAP)
    return sheet[top:top + SIDE, left:left + SIDE]


def _assert_solid_thumbnail(square: np.ndarray, color: tuple[int, int, int]) -> None:
    """A 40x30 image fills the square's middle 256x192 band; the frame shows above and below it."""
    band = square[32:224].reshape(-1, 3).astype(int)
    assert np.abs(band - color).max() <= 1  # LANCZOS of a flat image is flat, up to rounding
    assert (square[:32] == FRAME).all() and (square[224:] == FRAME).all()


def _assert_text_fits(sheet: np.ndarray, columns: int, tile_height: int) -> None:
    """Long labels and paths are cut with an ellipsis, not at the tile's edge: the last two pixel columns
    of every tile's text stay blank (the bars, at most 70% long here, do not reach them), and so do the
    gaps between tiles."""
    for column in range(columns + 1):
        left = column * (SIDE + GAP)
        assert (sheet[:, left:left + GAP] == PAPER).all(), f"ink in the gap left of column {column}"
    for top in range(GAP, sheet.shape[0] - GAP, tile_height + GAP):
        for column in range(columns):
            right = GAP + column * (SIDE + GAP) + SIDE
            assert (sheet[top + SIDE:top + tile_height, right - 2:right] == PAPER).all(), "text cut at the edge"


def test_70_inputs_make_a_sheet_of_64_and_one_of_6_in_input_order(tmp_path: Path) -> None:
    images = _solid_images(tmp_path / "in", 70)
    results = [_prediction(p) for p in images]
    results[65] = Prediction(str(images[65]), [], ImageNotFoundError(f"Cannot load image {images[65]}: gone"))
    stale = tmp_path / "sheet-3.png"  # a third sheet an earlier, longer run left: not one of this run's
    stale.write_bytes(b"old")
    with pytest.raises(InvalidArgumentError, match="sheet-3.png exists"):  # refused unless force=True
        write_contact_sheets(iter(results), tmp_path / "sheet.png")
    paths = write_contact_sheets(iter(results), tmp_path / "sheet.png", force=True)
    # Never deleted: only the sheets this run writes are replaced.
    assert paths == [tmp_path / "sheet.png", tmp_path / "sheet-2.png"] and stale.read_bytes() == b"old"
    for number, (path, first, count) in enumerate([(paths[0], 0, 64), (paths[1], 64, 6)], 1):
        assert sheet_path(tmp_path / "sheet.png", number) == path
        with Image.open(path) as image:
            assert image.format == "PNG" and image.mode == "RGB"
            columns, rows, tile_height = _grid(image, count)
            pixels = np.asarray(image)
        assert (columns, rows) == ((8, 8) if count == 64 else (6, 1))
        assert tile_height > SIDE + 4 * 14  # the name and 3 classes under each square
        _assert_text_fits(pixels, columns, tile_height)
        for i in range(count):
            square = _square(pixels, i, columns, tile_height)
            if first + i == 65:  # the failed input: a red square with the reason, no picture
                assert (square[-20:, -20:] == FAILED).all()
                assert (square != FAILED).any(axis=2).sum() > 200  # its text
            else:
                _assert_solid_thumbnail(square, _color(first + i))
            text = pixels[GAP + (i // columns) * (tile_height + GAP) + SIDE:, GAP + (i % columns) * (SIDE + GAP):][
                :tile_height - SIDE, :SIDE]
            assert (text != PAPER).any(axis=2).sum() > 100  # its name (and classes) are written under it


def test_a_sheet_is_written_as_soon_as_it_is_full(tmp_path: Path) -> None:
    images = _solid_images(tmp_path / "in", 66)
    first = tmp_path / "s.png"
    seen_before_the_end = []

    def stream() -> Iterator[Prediction]:
        for i, path in enumerate(images):
            if i == 65:  # 64 results handed over: the first sheet appears while inputs still come
                deadline = time.monotonic() + 60
                while not first.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                seen_before_the_end.append(first.exists())
            yield _prediction(path)

    assert write_contact_sheets(stream(), first, per_sheet=64) == [first, tmp_path / "s-2.png"]
    assert seen_before_the_end == [True]
    with Image.open(tmp_path / "s-2.png") as image:
        assert _grid(image, 2)[:2] == (2, 1)


def _photo_thumbnail(name: str) -> np.ndarray:
    """Independently: PIL reads the photo, upright RGB, scaled to fit 256 (upstream's thumbnail)."""
    with Image.open(EXAMPLES / name) as photo:
        photo = ImageOps.exif_transpose(photo).convert("RGB")
    scale = SIDE / max(photo.size)
    size = (round(photo.width * scale), round(photo.height * scale))
    return np.asarray(photo.resize(size, Image.Resampling.LANCZOS)).astype(int)


def _assert_centred(square: np.ndarray, expected: np.ndarray, name: str) -> None:
    height, width = expected.shape[:2]
    top, left = (SIDE - height) // 2, (SIDE - width) // 2
    got = square[top:top + height, left:left + width].astype(int)
    assert np.abs(got - expected).mean() < 1.0, name


def test_thumbnails_are_the_decoded_images_and_urls_are_downloaded_once(tmp_path: Path,
                                                                        http_server: LoopbackServer) -> None:
    """The sheet shows the images the predictions were decoded from (a decoding worker process included):
    a URL is downloaded once for both, and an input deleted after its prediction still has its picture.
    A prediction made without a thumbnail is read again; one whose second read fails keeps its tile and
    its classes, with the reason in place of the picture."""
    http_server.routes["/cat.png"] = Route((EXAMPLES / "chelsea.png").read_bytes(), content_type="image/png")
    url = f"{http_server.base_url}/cat.png"
    gone, gone_later = _solid_images(tmp_path / "in", 2)
    decoding = Decoding(preset=DEFAULT_PRESET, workers=1, thumbnail=SIDE)
    logits = torch.tensor([[3.0, 2.0, 1.0]])  # any model: the sheet draws what it gave
    results = list(iter_predict(lambda batch: logits.expand(len(batch), 3), [str(EXAMPLES / "rocket.jpg"), url,
                                str(gone)], labels=[LONG_LABEL, "tabby, tabby cat", "x"], topk=3, decoding=decoding))
    assert [r.thumbnail is not None for r in results] == [True, True, True]
    assert results[0] == Prediction(results[0].input, results[0].top)  # the thumbnail takes no part in equality
    gone.unlink()  # predicted, then deleted before its sheet is drawn: its picture is the decoded one
    without = [_prediction(EXAMPLES / "coffee.png"), _prediction(gone_later)]  # no thumbnail: read again
    gone_later.unlink()  # ... and this one cannot be: the tile says so
    with ContactSheetWriter(tmp_path / "p.png", timeout=10, allow_private=True) as writer:
        for result in results + without:
            writer.add(result)
    assert writer.paths == [tmp_path / "p.png"] and http_server.hits["/cat.png"] == 1
    with Image.open(tmp_path / "p.png") as image:
        columns, _, tile_height = _grid(image, 5)
        pixels = np.asarray(image)
    _assert_text_fits(pixels, columns, tile_height)
    for index, name in [(0, "rocket.jpg"), (1, "chelsea.png"), (3, "coffee.png")]:
        _assert_centred(_square(pixels, index, columns, tile_height), _photo_thumbnail(name), name)
    _assert_solid_thumbnail(_square(pixels, 2, columns, tile_height), _color(0))
    missing = _square(pixels, 4, columns, tile_height)
    assert (missing[-20:, -20:] == FRAME).all() and (missing != FRAME).any(axis=2).sum() > 200  # the reason
    # The classes of the input without a thumbnail are still drawn: its text area has as much ink as the
    # other read-again one's (same classes, names of the same length).
    below = [pixels[GAP + SIDE + 22:GAP + tile_height, GAP + i * (SIDE + GAP):GAP + i * (SIDE + GAP) + SIDE]
             for i in (3, 4)]
    assert abs(int((below[0] != PAPER).sum()) - int((below[1] != PAPER).sum())) < 50


def test_a_sheet_created_by_someone_else_during_the_run_is_not_overwritten(tmp_path: Path) -> None:
    """The destination is checked free at the start; a file put there before the sheet is written stays."""
    images = _solid_images(tmp_path / "in", 3)
    first, second = tmp_path / "s.png", tmp_path / "s-2.png"
    writer = ContactSheetWriter(first, per_sheet=2, interface="cli")
    writer.add(_prediction(images[0]))
    first.write_bytes(b"theirs")  # appears after the check, before the first sheet is written
    with pytest.raises(InvalidArgumentError) as caught:
        writer.add(_prediction(images[1]))  # fills the first sheet: drawn and written now, and refused
    assert str(first) in caught.value.message_for("cli") and "--show" in caught.value.message_for("cli")
    assert "created by someone else" in str(caught.value)
    with pytest.raises(InvalidArgumentError, match="closed"):  # it writes no more: no second sheet
        writer.add(_prediction(images[2]))
    assert writer.close() == []
    assert first.read_bytes() == b"theirs" and not second.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "s.png"]  # no temporary file left
    # With force, the writer's own choice, it is replaced.
    with ContactSheetWriter(first, per_sheet=2, force=True) as writer:
        writer.add(_prediction(images[0]))
    with Image.open(first) as image:
        assert image.format == "PNG"


@pytest.mark.parametrize("name, problem", [
    ("sheet.jpg", "ending in .png"), ("folder.png", "is a directory"), ("no/such/dir/s.png", "does not exist"),
    ("file.txt/s.png", "file.txt' is not a directory")])
def test_bad_destinations_are_refused_before_any_work(tmp_path: Path, name: str, problem: str) -> None:
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "folder.png").mkdir()
    target = tmp_path / name
    with pytest.raises(InvalidArgumentError, match=problem) as caught:
        check_sheet_destination(target, option="show")
    assert caught.value.cli.startswith(f"--show {target}") and str(caught.value).startswith("show=")
    with pytest.raises(UnknownArgumentError, match="per_page"):
        write_contact_sheets([], tmp_path / "s.png", per_page=3)


def test_no_results_write_no_sheet(tmp_path: Path) -> None:
    assert write_contact_sheets([], tmp_path / "s.png") == [] and list(tmp_path.iterdir()) == []


# --- the command line, in real subprocesses ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = randomize_bn(convnets.get_model("se_resnext101_32x4d", num_classes=5, **TINY["se_resnext101_32x4d"]))
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict(),
                "class_names": ["ant", "bee", "cat", "dog", "eel"], "epoch": 1}, path)
    return path


def test_cli_show_with_output_writes_two_sheets_of_71_inputs(tmp_path: Path, tiny_checkpoint: Path) -> None:
    images = _solid_images(tmp_path / "in", 70)
    listed = [str(p) for p in images[:65]] + [str(tmp_path / "missing.png")] + [str(p) for p in images[65:]]
    (tmp_path / "list.txt").write_text("\n".join(listed) + "\n")
    done = run_cli("predict", "--weights", str(tiny_checkpoint), "--from-file", str(tmp_path / "list.txt"),
                   "--output", str(tmp_path / "rec.jsonl"), "--show", str(tmp_path / "show.png"), "--topk", "2",
                   "--batch-size", "32")
    assert done.returncode == 1, done.stderr  # one input could not be read
    assert "Traceback" not in done.stderr and "contact sheets:" in done.stderr and done.stdout == ""
    records = [json.loads(line) for line in (tmp_path / "rec.jsonl").read_text().splitlines()]
    assert [r["input"] for r in records] == listed and "error" in records[65]
    for path, first, count in [(tmp_path / "show.png", 0, 64), (tmp_path / "show-2.png", 64, 7)]:
        with Image.open(path) as image:
            columns, _, tile_height = _grid(image, count)
            pixels = np.asarray(image)
        assert tile_height > SIDE + 3 * 14
        for i in range(count):
            square = _square(pixels, i, columns, tile_height)
            at = first + i
            if at == 65:
                assert (square[-20:, -20:] == FAILED).all()
            else:
                _assert_solid_thumbnail(square, _color(at if at < 65 else at - 1))
    assert not (tmp_path / "show-3.png").exists()


def test_cli_show_with_json_keeps_stdout_json(tmp_path: Path, tiny_checkpoint: Path,
                                             http_server: LoopbackServer) -> None:
    http_server.routes["/cat.png"] = Route((EXAMPLES / "chelsea.png").read_bytes(), content_type="image/png")
    done = run_cli("predict", "--weights", str(tiny_checkpoint), "--json", "--show", str(tmp_path / "ex.png"),
                   str(EXAMPLES), f"{http_server.base_url}/cat.png")
    assert done.returncode == 0, done.stderr
    assert [Path(r["input"]).name for r in json.loads(done.stdout)] == ["chelsea.png", "coffee.png", "rocket.jpg",
                                                                        "cat.png"]
    assert http_server.hits["/cat.png"] == 1  # its thumbnail is the image decoded for the model: one download
    with Image.open(tmp_path / "ex.png") as image:
        columns, _, tile_height = _grid(image, 4)
        _assert_centred(_square(np.asarray(image), 3, columns, tile_height), _photo_thumbnail("chelsea.png"), "URL")


@pytest.mark.parametrize("show, problem", [("out.jpg", "ending in .png"), ("no/such/dir/s.png", "does not exist")])
def test_cli_bad_show_fails_before_the_model_loads(tmp_path: Path, closed_port_url: str, show: str,
                                                   problem: str) -> None:
    # No weights cached and the mirror unreachable: loading the model first would fail on the download instead.
    done = run_cli("predict", "--show", str(tmp_path / show), str(EXAMPLES),
                   env={"CONVNETS_WEIGHTS_MIRROR": closed_port_url})
    assert done.returncode == 2 and "Traceback" not in done.stderr  # a usage error
    assert len(command_lines(done.stderr)) == 1 and f"--show {tmp_path / show}" in done.stderr
    assert problem in done.stderr
