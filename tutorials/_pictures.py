"""Make the README's tutorial pictures: run each notebook, keep one of its figures.

    python tutorials/_pictures.py            # writes tutorials/images/<notebook>.png

Each notebook runs in a fresh kernel (as nbval runs it); the chosen figure is the n-th
image the notebook displays, scaled to at most 900 pixels wide.
"""

import base64
import io
import pathlib

import nbformat
from nbclient import NotebookClient
from PIL import Image

HERE = pathlib.Path(__file__).parent
# notebook -> which of its displayed images the README shows (0 = the first)
CHOSEN = {
    "00_ranks": 0,  # all-reduce before / after
    "01_device_mesh": 4,  # [Shard(0), Shard(1)] on a 2x2 mesh
    "02_redistribute": 0,  # the collective of each transition
    "03_tensor_parallel": 2,  # the block's all-gathers and reduce-scatters
    "04_uneven_shards": 0,  # uneven row blocks
    "05_loss_parallel": 0,  # class-sharded logits
    "06_halo_convolution": 0,  # halos
    "07_ring_attention": 0,  # the ring's messages
    "08_fsdp_domain_parallel": 1,  # one training step: FSDP + halos
    "09_capstone_unet": 2,  # the two loss curves
}


def images_of(path: pathlib.Path) -> list[bytes]:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, resources={"metadata": {"path": str(HERE)}}).execute()
    return [
        base64.b64decode(out["data"]["image/png"])
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if "image/png" in out.get("data", {})
    ]


def main() -> None:
    out = HERE / "images"
    out.mkdir(exist_ok=True)
    for stem, index in CHOSEN.items():
        picture = Image.open(io.BytesIO(images_of(HERE / f"{stem}.ipynb")[index]))
        if picture.width > 900:
            picture = picture.resize((900, round(picture.height * 900 / picture.width)))
        picture.convert("RGB").save(out / f"{stem}.png", optimize=True)
        print(f"{stem}: image {index} -> {out / stem}.png")


if __name__ == "__main__":
    main()
